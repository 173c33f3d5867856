"""Where a new replica goes (``placement``): the choice alone. On a real multi-node cluster:
tests/multinode/test_multinode.py."""

from __future__ import annotations

from atomr_infer.control.placement import pick_node

FREE = {"a": {"GPU": 2.0, "CPU": 4.0}, "b": {"GPU": 2.0, "CPU": 4.0}, "c": {"GPU": 0.0, "CPU": 8.0}}
ONE_GPU = {"GPU": 1.0, "CPU": 1.0}


def test_spread_goes_where_the_deployment_has_fewest_replicas() -> None:
    assert pick_node("spread", FREE, ONE_GPU, []) in ("a", "b")
    assert pick_node("spread", FREE, ONE_GPU, ["a"]) == "b"
    assert pick_node("spread", FREE, ONE_GPU, ["a", "b", "a"]) == "b"


def test_pack_goes_where_the_deployment_already_is_while_it_fits() -> None:
    assert pick_node("pack", FREE, ONE_GPU, ["b"]) == "b"
    full_b = {**FREE, "b": {"GPU": 0.0, "CPU": 3.0}}
    assert pick_node("pack", full_b, ONE_GPU, ["b", "b"]) == "a"


def test_only_nodes_with_the_resources_free_are_candidates() -> None:
    assert pick_node("spread", FREE, {"GPU": 2.0, "CPU": 1.0}, ["a"]) == "b"
    assert pick_node("spread", FREE, {"GPU": 3.0, "CPU": 1.0}, []) is None  # one node never splits a replica
    assert pick_node("spread", FREE, {"CPU": 6.0}, []) == "c"
