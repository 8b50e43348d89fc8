"""Reading the communicator paths of a chaos trial from its members' logs (shared by the
gloo chaos tests and the NCCL runtime tests on the GPU machine)."""

from __future__ import annotations

import itertools


def reconfigurations(result) -> dict[str, list[dict]]:
    """Each incarnation's ``comm.reconfigured`` events, in time order."""
    return {inc: sorted((e for e in per if e.get("event") == "comm.reconfigured"), key=lambda e: e["_t"])
            for inc, per in result.evidence.logs.items()}


def assert_paths_name_their_epochs(result) -> dict[str, list[dict]]:
    """Every incarnation's first communicator is a "build" (a "grow" for a newcomer that
    joins the others' communicator), from no epoch; every later one is a rebuild or a fast
    path from the epoch it entered before, even when its old communicator was torn down
    before the new epoch came. Returns the events."""
    paths = reconfigurations(result)
    for inc, events in paths.items():
        if not events:
            continue
        assert events[0]["path"] in ("build", "grow") and events[0]["from_epoch"] is None, (inc, events[0])
        for before, after in itertools.pairwise(events):
            assert after["path"] != "build" and after["from_epoch"] == before["epoch"], (
                f"{inc} entered epoch {after['epoch']} by {after['path']!r} from {after['from_epoch']}, "
                f"after epoch {before['epoch']}")
    return paths


def path_into(paths: dict[str, list[dict]], incarnation_prefix: str) -> set[str]:
    """The paths the other ranks took into the epoch in which the incarnation named by
    ``incarnation_prefix`` (say ``i0-L1-``) formed its first communicator."""
    (inc,) = [i for i in paths if i.startswith(incarnation_prefix)]
    assert paths[inc], f"{inc} formed no communicator"
    epoch = paths[inc][0]["epoch"]
    return {e["path"] for i, events in paths.items() if i != inc for e in events if e["epoch"] == epoch}
