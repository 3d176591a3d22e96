"""Control-plane flows that every multi-machine executor must pass the same way (Ray, Slurm):
each runs the flow through the HTTP API, asserts what does not depend on the executor, and
hands back what the caller checks of its own executor (handles, GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _cpkit import CP
from _cpkit import train_doc as _train


def preempt_and_resume(cp: CP, dataset: Path, job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A low-class job of team research runs and checkpoints on the only GPU the test left
    usable; a high-class job of team vision arrives and preempts it. Both succeed: the victim
    stepped aside through its checkpoint (exit 75), was requeued, and resumed from that
    checkpoint. `job`: the job fields both share (resources, spot). Returns (low, high), their
    `jobs show` answers."""
    with cp.client() as c:
        # Enough steps that the preemption lands mid-training: 40 took 1.6 s on Ray, done before
        # the high job was even scheduled, and the SIGTERM met a trainer already exiting (143).
        low_spec = {**job, "train": _train(dataset, epochs=None, steps=400), "priority": "low"}
        low = c.post("/v1/jobs", json={"spec": low_spec, "team": "research"}).json()
        # Once it has checkpointed, the trainer is past start-up and has work to keep.
        cp.wait_job(low["id"], lambda j: j["state"] == "running" and j["last_checkpoint_at"] is not None)
        high_spec = {**job, "train": _train(dataset, epochs=None, steps=8), "priority": "high"}
        high = c.post("/v1/jobs", json={"spec": high_spec, "team": "vision"}).json()
    high_show = cp.wait_job(high["id"], lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    assert high_show["job"]["state"] == "succeeded", high_show
    low_show = cp.wait_job(low["id"], lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    done = low_show["job"]
    assert done["state"] == "succeeded" and done["preemptions"] == 1 and done["restarts"] == 0, low_show
    states = [t["to_state"] for t in low_show["transitions"]]
    assert states == ["queued", "running", "preempting", "queued", "running", "succeeded"]
    assert f"job {high['id']}" in low_show["transitions"][2]["reason"]
    first, second = low_show["attempts"]
    assert (first["outcome"], first["exit_code"], second["outcome"]) == ("preempted", 75, "succeeded")
    with cp.client() as c:
        second_log = c.get(f"/v1/jobs/{low['id']}/logs", params={"attempt": 2}).text
    assert "resuming from step-" in second_log, second_log
    for show in (low_show, high_show):
        assert (Path(show["job"]["run_dir"]) / "final.safetensors").is_file()
    return low_show, high_show


def two_node_job(cp: CP, dataset: Path, resources: dict[str, Any]) -> dict[str, Any]:
    """A CPU training job on two nodes (`resources`, with nodes: 2) runs as one process group
    of two ranks and succeeds. Returns its one attempt, as `jobs show` gives it."""
    train = _train(dataset, epochs=None, steps=6, device="cpu")
    with cp.client() as c:
        job = c.post(
            "/v1/jobs", json={"spec": {"train": train, "resources": resources}, "team": "vision"}
        ).json()
    assert job["nodes"] == 2
    show = cp.wait_job(job["id"], lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    assert show["job"]["state"] == "succeeded", show
    (attempt,) = show["attempts"]
    with cp.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs", params={"attempt": 1}).text
    assert ", 2 processes" in log, log[-3000:]  # one process group of two ranks
    assert (Path(show["job"]["run_dir"]) / "final.safetensors").is_file()
    return dict(attempt)
