"""``_restore/mapping.py``: what a rank keeps of a memory-mapped checkpoint is copied out of the mapping, and nothing
else; views of one storage stay views of one copy."""

from __future__ import annotations

from pathlib import Path

import torch

from serialized_restore._restore.mapping import copy_kept_out_of_mapping, copy_modules_out_of_mapping, storages_of


def test_only_the_state_an_optimizer_keeps_is_copied_out_of_the_mapping(tmp_path: Path) -> None:
    """After ``load_state_dict`` of memory-mapped state, exactly the tensors the optimizer kept are copied: into
    private memory, values equal, aliases kept together; state the optimizer does not hold is not copied."""
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    trained = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    trained.step()
    torch.save({"optimizer": trained.state_dict(), "extra": torch.ones(1000)}, tmp_path / "o.pt")
    mapped = torch.load(tmp_path / "o.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped["optimizer"])
    assert mapped["extra"].untyped_storage().data_ptr() not in storages

    fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    fresh.load_state_dict(mapped["optimizer"])
    held = [s["exp_avg"] for s in fresh.state.values()]
    assert all(t.untyped_storage().data_ptr() in storages for t in held)  # Adam on CPU keeps the mapped tensors
    copied = copy_kept_out_of_mapping([fresh], storages)
    # exp_avg and exp_avg_sq of both parameters and the two step counters: what Adam keeps, and nothing else
    assert copied == 2 * (4 + 3) * 4 + 2 * 4
    for state, expected in zip(fresh.state.values(), trained.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert state[key].untyped_storage().data_ptr() not in storages
            assert torch.equal(state[key], expected[key])
    assert copy_kept_out_of_mapping([fresh], storages) == 0  # nothing mapped is left


def test_state_an_optimizer_dropped_is_not_copied_and_views_stay_views(tmp_path: Path) -> None:
    """Of mapped state, what the optimizer no longer holds (a sharded optimizer's other shards) is not copied, and
    kept tensors that were views of one storage (in tuples too) are copied as one storage and stay views of it."""
    flat = torch.arange(12.0)
    shared = {"views": (flat[:6], flat[6:]), "alone": torch.ones(5)}
    torch.save({"kept": shared, "dropped": torch.zeros(1000)}, tmp_path / "s.pt")
    mapped = torch.load(tmp_path / "s.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.state[optimizer.param_groups[0]["params"][0]] = mapped["kept"]  # what load_state_dict would keep
    copied = copy_kept_out_of_mapping([optimizer], storages)
    assert copied == 12 * 4 + 5 * 4  # the views' storage once, the lone tensor; nothing of "dropped"
    (state,) = optimizer.state.values()
    first, second = state["views"]
    assert isinstance(state["views"], tuple) and first.untyped_storage().data_ptr() not in storages
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([first, second]), flat) and torch.equal(state["alone"], torch.ones(5))
    assert mapped["dropped"].untyped_storage().data_ptr() in storages  # still the file's: never copied


def test_what_a_module_kept_instead_of_copying_is_copied_out_and_nothing_else(tmp_path: Path) -> None:
    """A parameter assigned from the mapping keeps its identity and gets private data; a buffer, a tensor attribute and
    a list attribute's tensors that lie in the mapping are copied, in a submodule too; the module's own tensors and
    what is not a tensor stay as they are."""
    torch.save({"w": torch.arange(4.0), "b": torch.ones(2), "s": torch.full((3,), 2.0), "l": torch.zeros(5)},
               tmp_path / "m.pt")  # fmt: skip
    mapped = torch.load(tmp_path / "m.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped)
    inner = torch.nn.Linear(2, 2)
    own_weight = inner.weight.data
    inner.bias = torch.nn.Parameter(mapped["b"])  # as `load_state_dict(assign=True)` leaves it
    bias = inner.bias
    inner.register_buffer("kept", mapped["w"])
    outer = torch.nn.Sequential(inner)
    outer.state = mapped["s"]
    outer.states = [mapped["l"], "not a tensor"]

    copied = copy_modules_out_of_mapping([outer], storages)

    assert copied == (2 + 4 + 3 + 5) * 4
    assert inner.bias is bias and inner.weight.data.data_ptr() == own_weight.data_ptr()
    for tensor, key in ((inner.bias, "b"), (inner.kept, "w"), (outer.state, "s"), (outer.states[0], "l")):
        assert tensor.untyped_storage().data_ptr() not in storages
        assert torch.equal(tensor, mapped[key])
    assert outer.states[1] == "not a tensor"
    assert copy_modules_out_of_mapping([outer], storages) == 0  # nothing mapped is left


def test_tied_weights_stay_tied_and_wrapper_subclasses_are_left_alone(tmp_path: Path) -> None:
    """Two parameters assigned from one mapped storage (tied weights) share one private copy afterwards; a parameter
    and a buffer of a wrapper subclass with no storage of its own (as ``DTensor``) are left as they are, no error."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.save({"shared": torch.arange(8.0)}, tmp_path / "t.pt")
    mapped = torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)
    storages = storages_of(mapped)
    embedding, head = torch.nn.Module(), torch.nn.Module()
    embedding.weight = torch.nn.Parameter(mapped["shared"][:4])  # as `load_state_dict(assign=True)` leaves them
    head.weight = torch.nn.Parameter(mapped["shared"][:4])
    wrapped = torch.nn.Module()
    wrapped.weight = torch.nn.Parameter(TwoTensor(torch.ones(2), torch.ones(2)))
    wrapped.register_buffer("scale", TwoTensor(torch.ones(1), torch.ones(1)))
    weight, scale = wrapped.weight, wrapped.scale

    copied = copy_modules_out_of_mapping([torch.nn.ModuleList([embedding, head, wrapped])], storages)

    assert copied == 8 * 4  # the shared storage once
    assert embedding.weight.untyped_storage().data_ptr() not in storages
    assert embedding.weight.data_ptr() == head.weight.data_ptr()
    assert torch.equal(head.weight, torch.arange(4.0))
    assert wrapped.weight is weight and wrapped.scale is scale
