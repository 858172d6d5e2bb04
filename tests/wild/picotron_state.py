"""picotron's style of parallel state: a module-global manager holding the tp group, set once per
process by ``setup_process_group_manager`` (here: ``setup``)."""

from __future__ import annotations

process_group_manager = None


class _Manager:
    def __init__(self, group) -> None:
        import torch.distributed as dist

        self.tp_group = group
        self.tp_world_size = dist.get_world_size(group)
        self.tp_rank = dist.get_rank(group)


def setup(group) -> None:
    global process_group_manager
    process_group_manager = _Manager(group)
