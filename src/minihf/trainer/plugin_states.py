"""The plug-ins' states in a checkpoint (``PluginStates``), checked as they are taken and
as they are given back (``minihf.trainer.phases`` for the plug-ins themselves)."""

from __future__ import annotations

from minihf.trainer.phases import Plugin, plugin_label
from minihf.utils.state_json import StateError, encode


class PluginStates:
    """The plug-ins' states as one entry of the driver state, by plug-in name (a plug-in
    new to a resumed run starts fresh). Each state is checked as it is taken: what a
    checkpoint cannot hold is a ``StateError`` naming the plug-in and the path."""

    def __init__(self, plugins: list[Plugin]):
        self.plugins = plugins

    def state_dict(self) -> dict:
        out = {}
        for p in self.plugins:
            state = p.state_dict()
            try:
                encode(state, "state_dict()")
            except StateError as e:
                raise StateError(f"{plugin_label(p)}: {e}") from None
            out[p.key()] = state
        return out

    def load_state_dict(self, state: dict) -> None:
        for p in self.plugins:
            if p.key() in state:
                try:
                    p.load_state_dict(state[p.key()])
                except Exception as e:  # the plug-in's own code: name it, and what it raised
                    raise StateError(f"{plugin_label(p)}: load_state_dict() raised {type(e).__name__}: "
                                     f"{str(e)[:200]} on the state saved for it; make it read what its "
                                     "state_dict() saves") from e
