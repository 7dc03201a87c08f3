"""``FrozenModelWorker``: the base of the inference-only roles (a reward or cost model, a
``LogProbWorker``): one frozen FSDP model of the class's ``head`` over the role's ranks,
built by ``init_model`` from the config's ``model`` and ``fsdp`` sections."""

from __future__ import annotations

from typing import Any

from minihf.controller import Dispatch, Worker, register
from minihf.workers.engine import build_fsdp_model


class FrozenModelWorker(Worker):
    head = "lm"                        # the model head: lm | score | value

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        c = self.config
        self.model = build_fsdp_model(c.model, c.fsdp, head=self.head, group=self.group,
                                      device=self.device, trainable=False)

    def built(self):
        """The model, once ``init_model`` has run."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} ({self.role}): call init_model() first")
        return self.model
