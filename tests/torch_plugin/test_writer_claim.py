"""``ttp``'s one writer per shard: the claim on torchrun's store, whatever prefix the default group's store has."""

from __future__ import annotations

import pytest

KEY = "ft_plugins/ttp/0/4/mp_rank_00"


def test_survivors_of_different_group_generations_claim_one_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A survivor holding (``recover``'s stand-in group) and a replacement already joined to generation 1 see
    the one store of the job under different prefixes: one of them writes the shard, not both."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ft_plugins.torch.store import claim

    job = dist.HashStore()
    seen = iter([dist.PrefixStore("hold/", dist.PrefixStore("workers/", job)),
                 dist.PrefixStore("1/world/", dist.PrefixStore("workers/", job)), dist.PrefixStore("default_pg/", job)])
    monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: next(seen))
    assert [claim(KEY), claim(KEY), claim(KEY)] == [True, False, False]
