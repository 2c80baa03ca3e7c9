"""HERON_CPU_OMP_THREADS_BIND: which cores each rank's threads are pinned to."""

from __future__ import annotations

import pytest

from heron.worker.cpu_binding import cpus_for_rank, parse_cpu_list


def test_cpu_lists_parse_ranges_and_singles():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list("3") == [3]
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list("a-b")


def test_nobind_and_unset_pin_nothing():
    assert cpus_for_rank(None, 2, 0, 1, [0, 1]) is None
    assert cpus_for_rank("nobind", 2, 0, 1, [0, 1]) is None


def test_auto_takes_the_last_cores_one_set_per_rank():
    assert cpus_for_rank("auto", 2, 0, 1, [0, 1]) == [0, 1]
    assert cpus_for_rank("auto", 1, 0, 1, [0, 1]) == [1]  # core 0 stays for the API server
    assert cpus_for_rank("auto", 3, 0, 2, list(range(8))) == [2, 3, 4]
    assert cpus_for_rank("auto", 3, 1, 2, list(range(8))) == [5, 6, 7]
    assert cpus_for_rank("auto", 2, 0, 1, [4, 6, 9]) == [6, 9]  # an affinity mask's cores


def test_explicit_lists_per_node_or_per_rank():
    assert cpus_for_rank("0-1", 2, 0, 1, [0, 1]) == [0, 1]
    assert cpus_for_rank("0-1|2-3", 2, 1, 2, list(range(4))) == [2, 3]
    with pytest.raises(ValueError, match="3 lists for 2 ranks"):
        cpus_for_rank("0|1|2", 1, 0, 2, list(range(4)))


def test_a_list_that_does_not_fit_the_threads_or_the_machine_is_refused():
    with pytest.raises(ValueError, match="1 cores for 2 threads"):
        cpus_for_rank("0", 2, 0, 1, [0, 1])
    with pytest.raises(ValueError, match="not among those this process may use"):
        cpus_for_rank("0-1", 2, 0, 1, [0, 5])
    with pytest.raises(ValueError, match="3 cores for 4 threads"):
        cpus_for_rank("auto", 4, 0, 1, [0, 1, 2])
