"""The guess-the-number environment (one instance per sample; minihf.multi_turn.loop).

The secret is a digit in the prompt's range ``lo-hi``. Each assistant turn is one guess;
the answer is ``>`` (the secret is larger), ``<`` (smaller) or ``?`` (not a single digit),
and a right guess ends the episode with reward ``1.0 - 0.1 * (turns - 1)``: finding it
pays, finding it sooner pays more. The episode also ends after
``multi_turn.max_assistant_turns`` guesses (reward 0).
"""

from minihf.data.tasks.guess import feedback


class GuessNumber:
    def __init__(self, row: dict):
        self.secret = int(row["reward_model"]["ground_truth"])
        self.turns = 0

    def reset(self):
        return None

    def step(self, action: str):
        self.turns += 1
        text = action.strip()
        if len(text) != 1 or not text.isdigit():
            return "?", 0.0, False
        answer = feedback(int(text), self.secret)
        if answer is None:
            return None, 1.0 - 0.1 * (self.turns - 1), True
        return answer, 0.0, False
