"""The spool: how an RL run hands rollouts and policy checkpoints to ``draftadapt sidecar``.

``format.py`` defines it (names, tensors, manifest fields and their checks), ``writer.py`` is the
RL side's reference writer and ``reader.py`` the sidecar's reader. ``docs/spool-format.md``
documents it for writers in other languages.
"""

from draftadapt.spool.format import SpoolFormatError, policy_name, rollout_name
from draftadapt.spool.reader import (
    PolicyCheckpoint,
    PolicyRef,
    RolloutShard,
    ShardRef,
    SpoolCursor,
    SpoolReader,
)
from draftadapt.spool.writer import SpoolWriter

__all__ = [
    "PolicyCheckpoint",
    "PolicyRef",
    "RolloutShard",
    "ShardRef",
    "SpoolCursor",
    "SpoolFormatError",
    "SpoolReader",
    "SpoolWriter",
    "policy_name",
    "rollout_name",
]
