"""How a role's ranks are arranged into data-parallel and tensor-parallel groups.

Pure data and arithmetic (no torch), unit-tested alone. A role has one ``RoleLayout`` per
named layout over the same ranks; every worker method says which one it uses
(``@register(..., layout="rollout")``):

* ``default``: the placement's TP size (1 unless ``placement.<role>.tp_size`` says
  otherwise), TP innermost: role rank ``i`` has ``dp_rank = i // t`` and
  ``tp_rank = i % t``, so a replica is ``t`` consecutive ranks. Training and scoring use it.
* a *strided* layout (``tp_strided=True``, declared by the worker class, e.g. the actor's
  ``rollout`` layout of TP size ``rollout.tensor_model_parallel_size``): TP outermost,
  ``dp_rank = i % d`` and ``tp_rank = i // d`` with ``d = N / t``. TP rank ``j`` lives on role
  ranks ``j*d .. (j+1)*d - 1`` and one replica is ``{i, i + d, i + 2d, ...}``. The ``d``
  consecutive ranks sharing a TP rank (the layout's DP group) are exactly the ranks whose
  FSDP shards make up TP shard ``j`` (see ``minihf.reshard``).
"""

from __future__ import annotations

from dataclasses import dataclass

from minihf.config import ConfigError

DEFAULT_LAYOUT = "default"


@dataclass(frozen=True)
class RoleLayout:
    """A role's global ranks (role rank ``i`` is ``ranks[i]``) arranged as DP x TP."""
    role: str
    ranks: tuple[int, ...]
    tp_size: int = 1
    tp_strided: bool = False  # TP outermost (generation layouts), see the module docstring
    name: str = DEFAULT_LAYOUT

    def __post_init__(self):
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"role {self.role!r}: ranks {list(self.ranks)} must be non-empty "
                              "and distinct")
        if not isinstance(self.tp_size, int) or self.tp_size < 1 or len(self.ranks) % self.tp_size:
            raise ConfigError(f"role {self.role!r}, layout {self.name!r}: tp_size={self.tp_size} "
                              f"does not divide the role's {len(self.ranks)} ranks "
                              f"{list(self.ranks)}; use one of {divisors(len(self.ranks))}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def dp_size(self) -> int:
        return len(self.ranks) // self.tp_size

    def dp_rank(self, role_rank: int) -> int:
        return role_rank % self.dp_size if self.tp_strided else role_rank // self.tp_size

    def tp_rank(self, role_rank: int) -> int:
        return role_rank // self.dp_size if self.tp_strided else role_rank % self.tp_size

    def role_rank(self, dp_rank: int, tp_rank: int) -> int:
        """The role rank holding (``dp_rank``, ``tp_rank``)."""
        if self.tp_strided:
            return tp_rank * self.dp_size + dp_rank
        return dp_rank * self.tp_size + tp_rank

    def tp_group_ranks(self, role_rank: int) -> tuple[int, ...]:
        """Global ranks of the TP group (one model replica) holding ``role_rank``, by TP rank."""
        d = self.dp_rank(role_rank)
        return tuple(self.ranks[self.role_rank(d, t)] for t in range(self.tp_size))

    def dp_group_ranks(self, role_rank: int) -> tuple[int, ...]:
        """Global ranks with the same TP rank as ``role_rank``, one per DP rank, in DP order."""
        t = self.tp_rank(role_rank)
        return tuple(self.ranks[self.role_rank(d, t)] for d in range(self.dp_size))

    def tp_ranks(self) -> dict[int, int]:
        """Each global rank's TP rank."""
        return {rank: self.tp_rank(i) for i, rank in enumerate(self.ranks)}

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every TP group (replica), by DP rank."""
        return [self.tp_group_ranks(self.role_rank(d, 0)) for d in range(self.dp_size)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Every DP group, by TP rank."""
        return [self.dp_group_ranks(self.role_rank(0, t)) for t in range(self.tp_size)]

    def with_tp(self, name: str, tp_size: int, tp_strided: bool = True) -> RoleLayout:
        """Another layout of the same ranks."""
        return RoleLayout(self.role, self.ranks, tp_size, tp_strided, name)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
