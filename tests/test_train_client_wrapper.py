"""``train_client`` (the progress wrapper) takes and forwards every keyword of ``_train_client`` (the job).

The two once repeated one long signature, and a merge dropped ``transform`` from the forward: a
Byzantine client then uploaded its honest update. Here the job is replaced by a recorder, the wrapper
is called with a distinct value for each of the job's keywords, and each must arrive unchanged.
"""

from __future__ import annotations

import inspect

import pytest

from fedagent.train import local
from fedagent.train.params import TrainParams


def test_the_wrapper_forwards_every_keyword_of_the_job(monkeypatch):
    job = inspect.signature(local._train_client).parameters
    positional = [n for n, p in job.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = [n for n, p in job.items() if p.kind is p.KEYWORD_ONLY and n != "on_done"]
    assert {"round", "client", "params", "threads", "out_dir", "transform"} <= set(keywords)
    sent = {n: object() for n in keywords}
    sent["params"] = TrainParams(epochs=2, groups_per_epoch=3, group_size=2)
    got = {}

    def recorder(*args, **kwargs):
        got.update(zip(positional, args), **kwargs)
        return {"recorded": True}

    monkeypatch.setattr(local, "_train_client", recorder)
    args = [object() for _ in positional]
    assert local.train_client(*args, **sent) == {"recorded": True}
    for name, value in [*zip(positional, args), *sent.items()]:
        assert got.get(name, None) is value, f"train_client does not forward {name!r} to _train_client"
    # The progress line's counter: one episode per call, of epochs × groups_per_epoch × group_size.
    assert got["on_done"].__self__.total == 12


def test_an_unknown_keyword_is_an_error():
    with pytest.raises(TypeError, match="no_such_knob"):
        local.train_client(
            None, None, None, round=1, client=0, params=TrainParams(), threads=1, out_dir=None, no_such_knob=1
        )
