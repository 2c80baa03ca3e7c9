"""Tensor, context and pipeline parallelism: process groups and their collectives."""

from heron.distributed.parallel_state import (GroupCoordinator, destroy_parallel, get_cp_group,
                                              get_pp_group, get_tp_group, init_parallel)

__all__ = ["GroupCoordinator", "destroy_parallel", "get_cp_group", "get_pp_group",
           "get_tp_group", "init_parallel"]
