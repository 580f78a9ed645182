"""State capture and restore: tied weights, optimizer by name, key errors, dtypes, sampler."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memckpt
from memckpt.errors import StateError


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor's values in logical order (NaN payloads, -0.0 included)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: {a.shape} != {b.shape}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: values differ"


def _snapshot_and_restore(ram_root, state, fresh_state, step=1, via_file=None):
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    assert ckpt.step(state, step)
    ckpt.wait()
    if via_file is not None:
        ckpt.save(via_file)
        got = ckpt.restore(fresh_state, source=via_file)
    else:
        got = ckpt.restore(fresh_state)
    assert got == step
    return ckpt


# ---- tied weights ------------------------------------------------------------------------

class TiedLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _lm_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 50, (4, 6), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 50), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("via", ["ram", "file"])
def test_tied_weights_stored_once_and_still_tied_after_restore(ram_root, tmp_path, via):
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in (1, 2):
        _lm_step(model, opt, s)
    state = memckpt.TrainState(model=model, optimizer=opt)

    cap = state.capture(2)
    names = [n for n, _ in cap.tensors]
    assert "model/model/emb.weight" in names
    assert "model/model/head.weight" not in names
    assert cap.meta["aliases"] == {"model/model/head.weight": "model/model/emb.weight"}
    assert cap.meta["models"]["model"] == list(model.state_dict().keys())  # both keys listed
    optim_names = [n for n in names if n.startswith("optim/")]
    assert not any("head.weight" in n for n in optim_names)  # state of the shared param once
    assert cap.nbytes == sum(t.numel() * t.element_size() for _, t in cap.tensors)

    torch.manual_seed(123)
    fresh = TiedLM()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh.emb.weight, model.emb.weight)
    ckpt = _snapshot_and_restore(ram_root, state, memckpt.TrainState(model=fresh, optimizer=fresh_opt),
                                 step=2, via_file=tmp_path / "s.shard" if via == "file" else None)
    with ckpt.engine.reading(2) as shard:
        stored = [e.name for e in shard.layout.entries]
        assert "model/model/emb.weight" in stored and "model/model/head.weight" not in stored
    assert fresh.emb.weight is fresh.head.weight
    assert fresh.emb.weight.data_ptr() == fresh.head.weight.data_ptr()
    assert_bitwise(fresh.emb.weight, model.emb.weight, "emb")
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert_bitwise(a, b, n)
    # and training continues identically, the tie included
    for s in (3, 4):
        assert _lm_step(model, opt, s) == _lm_step(fresh, fresh_opt, s)
    assert fresh.emb.weight is fresh.head.weight
    assert_bitwise(fresh.head.weight, model.head.weight, "head after training")
    ckpt.close(unlink=True)


# ---- optimizer state keyed by parameter name -------------------------------------------------

class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)  # same shapes as l2: a positional mix-up would go unnoticed by shape
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.relu(self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))))


def _mlp_opt(model, order="same", groups="same"):
    p = dict(model.named_parameters())
    decay = [p[n] for n in ("l1.weight", "l2.weight", "l3.weight", "out.weight")]
    no_decay = [p[n] for n in ("l1.bias", "l2.bias", "l3.bias", "out.bias")]
    if order == "reversed":
        decay, no_decay = decay[::-1], no_decay[::-1]
    pg = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]
    if groups == "swapped":
        pg = pg[::-1]
    return torch.optim.AdamW(pg, lr=1e-2)


def _mlp_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("order,groups", [("reversed", "same"), ("reversed", "swapped"),
                                          ("same", "swapped")])
def test_optimizer_state_follows_parameter_names_not_positions(ram_root, order, groups):
    torch.manual_seed(0)
    model = MLP()
    opt = _mlp_opt(model)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    state = memckpt.TrainState(model=model, optimizer=opt)
    for s in range(1, 4):
        _mlp_step(model, opt, s)
    ckpt.step(state, 3)
    ckpt.wait()
    want_losses = [_mlp_step(model, opt, s) for s in range(4, 9)]

    torch.manual_seed(99)
    fresh = MLP()
    fresh_opt = _mlp_opt(fresh, order, groups)
    assert ckpt.restore(memckpt.TrainState(model=fresh, optimizer=fresh_opt)) == 3
    with ckpt.engine.reading(3) as shard:
        by_name = dict(fresh.named_parameters())
        for pname, param in by_name.items():
            st = fresh_opt.state[param]
            assert_bitwise(st["exp_avg"], shard.tensors[f"optim/optimizer/model/{pname}/exp_avg"], pname)
            assert_bitwise(st["exp_avg_sq"],
                           shard.tensors[f"optim/optimizer/model/{pname}/exp_avg_sq"], pname)
    for group in fresh_opt.param_groups:  # hyperparameters went to the group holding the params
        names = {n for n, p in fresh.named_parameters() if any(p is q for q in group["params"])}
        decay = all(n.endswith("weight") for n in names)
        assert group["weight_decay"] == (0.1 if decay else 0.0)
        assert group["lr"] == (1e-2 if decay else 3e-3)
    got_losses = [_mlp_step(fresh, fresh_opt, s) for s in range(4, 9)]
    assert got_losses == want_losses
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert_bitwise(a, b, n)
    ckpt.close(unlink=True)


# ---- missing / unexpected keys are named ----------------------------------------------------

class MLP2(MLP):
    """MLP without l3 and with an extra layer l4."""

    def __init__(self) -> None:
        super().__init__()
        del self.l3
        self.l4 = nn.Linear(16, 4)


def _saved(ram_root, model, opt=None, **kw):
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, **kw))
    ckpt.step(memckpt.TrainState(model=model, optimizer=opt), 1)
    ckpt.wait()
    return ckpt


def test_model_missing_and_unexpected_keys_are_named(ram_root):
    torch.manual_seed(0)
    ckpt = _saved(ram_root, MLP())
    other = MLP2()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateError) as ei:
        ckpt.restore(memckpt.TrainState(model=other))
    msg = str(ei.value)
    assert "model 'model'" in msg
    assert "missing keys: [l4.bias, l4.weight]" in msg  # the live model wants them
    assert "unexpected keys: [l3.bias, l3.weight]" in msg  # only the snapshot has them
    for k, v in other.state_dict().items():  # nothing half-loaded
        assert torch.equal(v, before[k]), k
    ckpt.close(unlink=True)


def test_model_and_optimizer_names_must_match(ram_root):
    torch.manual_seed(0)
    model = MLP()
    ckpt = _saved(ram_root, {"student": model}, {"adam": torch.optim.Adam(model.parameters())})
    with pytest.raises(StateError, match=r"model names differ: the snapshot has \[student\], "
                                         r"the TrainState has \[teacher\]"):
        ckpt.restore(memckpt.TrainState(model={"teacher": MLP()}))
    m = MLP()
    with pytest.raises(StateError, match=r"optimizer names differ: the snapshot has \[adam\], "
                                         r"the TrainState has \[sgd\]"):
        ckpt.restore(memckpt.TrainState(model={"student": m},
                                        optimizer={"sgd": torch.optim.SGD(m.parameters(), lr=1)}))
    ckpt.close(unlink=True)


def test_optimizer_missing_and_unexpected_params_are_named(ram_root):
    torch.manual_seed(0)
    model = MLP()
    p = dict(model.named_parameters())
    opt = torch.optim.SGD([p["l1.weight"], p["l1.bias"], p["l2.weight"], p["l2.bias"]],
                          lr=0.1, momentum=0.9)
    _mlp_step(model, opt, 1)
    ckpt = _saved(ram_root, model, opt)
    fresh = MLP()
    q = dict(fresh.named_parameters())
    fresh_opt = torch.optim.SGD([q["l1.weight"], q["l1.bias"], q["l3.weight"], q["l3.bias"]],
                                lr=0.1, momentum=0.9)
    with pytest.raises(StateError) as ei:
        ckpt.restore(memckpt.TrainState(model=fresh, optimizer=fresh_opt))
    msg = str(ei.value)
    assert "optimizer 'optimizer'" in msg
    # same wording as for models: "missing" = the live side wants it, the snapshot lacks it
    assert "missing params: [model/l3.bias, model/l3.weight]" in msg
    assert "unexpected params: [model/l2.bias, model/l2.weight]" in msg

    two_groups = torch.optim.SGD([{"params": [q["l1.weight"]]}, {"params": [q["l1.bias"]]}], lr=0.1)
    with pytest.raises(StateError, match="has 2 param groups, the snapshot has 1"):
        ckpt.restore(memckpt.TrainState(model=fresh, optimizer=two_groups))
    ckpt.close(unlink=True)


def test_optimizer_over_a_parameter_outside_the_models_is_refused():
    model = MLP()
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(StateError, match=r"shape \(3, 5\).*pass its model too"):
        memckpt.TrainState(model=model, optimizer=opt).capture(1)


# ---- every dtype, odd shapes, strides --------------------------------------------------------

class AllDtypes(nn.Module):
    def __init__(self, fill: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)

        def f(t):
            return t if fill else torch.zeros_like(t)

        special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-42, 3.5])
        self.register_buffer("f32", f(torch.cat([special, torch.randn(9, generator=g)])))
        self.register_buffer("f64", f(torch.randn(3, 4, generator=g, dtype=torch.float64)))
        self.register_buffer("bf16", f(torch.randn(17, generator=g).to(torch.bfloat16)))
        self.register_buffer("f16", f(torch.cat([special, torch.randn(5, generator=g)]).to(torch.float16)))
        self.register_buffer("i64", f(torch.tensor([-(2 ** 63), 2 ** 63 - 1, 0, -1, 12345678901234])))
        self.register_buffer("i32", f(torch.tensor([-(2 ** 31), 2 ** 31 - 1, 7], dtype=torch.int32)))
        self.register_buffer("i8", f(torch.tensor([-128, 127, 0, -1], dtype=torch.int8)))
        self.register_buffer("u8", f(torch.arange(256, dtype=torch.int64).to(torch.uint8)))
        self.register_buffer("flags", f(torch.tensor([True, False, True, True, False])))
        self.register_buffer("c64", f(torch.randn(3, generator=g, dtype=torch.complex64)))
        self.register_buffer("transposed", f(torch.randn(5, 3, generator=g)).t())  # non-contiguous
        self.register_buffer("strided", f(torch.arange(40, dtype=torch.int32).reshape(4, 10))[:, ::3])
        self.register_buffer("scalar", f(torch.tensor(2.75, dtype=torch.float64)))
        self.register_buffer("scalar_int", f(torch.tensor(-9)))
        self.register_buffer("scalar_bool", torch.tensor(fill))
        self.register_buffer("empty", torch.empty(0, 3))
        self.register_buffer("empty_i64", torch.empty(0, dtype=torch.int64))
        self.weight_t = nn.Parameter(f(torch.randn(4, 6, generator=g)).t())  # non-contiguous param
        self.half_param = nn.Parameter(f(torch.randn(4, 2, generator=g)).to(torch.bfloat16))


@pytest.mark.parametrize("via", ["ram", "file"])
def test_all_dtypes_and_layouts_round_trip_bit_exactly(ram_root, tmp_path, via):
    src, dst = AllDtypes(fill=True), AllDtypes(fill=False)
    assert not src.transposed.is_contiguous() and not src.weight_t.is_contiguous()
    assert not src.strided.is_contiguous()
    ckpt = _snapshot_and_restore(ram_root, memckpt.TrainState(model=src),
                                 memckpt.TrainState(model=dst),
                                 via_file=tmp_path / "d.shard" if via == "file" else None)
    src_sd, dst_sd = src.state_dict(), dst.state_dict()
    assert list(src_sd) == list(dst_sd)
    for name, t in src_sd.items():
        assert_bitwise(dst_sd[name], t, name)
    assert torch.isnan(dst.f32[4]) and torch.signbit(dst.f32[1]) and dst.f32[5] != 0  # subnormal kept
    assert dst.scalar.dim() == 0 and dst.empty.shape == (0, 3)
    with ckpt.engine.reading(1) as shard:
        dtypes = {e.name.rsplit("/", 1)[1]: e.dtype for e in shard.layout.entries}
    assert dtypes["bf16"] == "bfloat16" and dtypes["flags"] == "bool" and dtypes["u8"] == "uint8"
    assert dtypes["transposed"] == "float32" and dtypes["c64"] == "complex64"
    ckpt.close(unlink=True)


# ---- other state kinds ------------------------------------------------------------------------

class Cursor:
    """A data position whose state uses numpy arrays, tuples and non-string keys."""

    def __init__(self) -> None:
        self.pos = 0
        self.hist = np.zeros(4, dtype=np.int64)
        self.table = {1: "a", 2: "b"}
        self.loss_ema = np.array(0.25)  # a 0-d array
        self.mask = np.ones((2, 3), dtype=bool)

    def state_dict(self):
        return {"pos": self.pos, "hist": self.hist.copy(), "window": (self.pos, self.pos + 3),
                "table": dict(self.table), "np_scalar": np.float32(0.5),
                "loss_ema": self.loss_ema.copy(), "mask": self.mask[:, ::2]}

    def load_state_dict(self, sd):
        self.pos, self.hist, self.table = sd["pos"], sd["hist"], sd["table"]
        self.loss_ema, self.mask = sd["loss_ema"], sd["mask"]
        self.window = sd["window"]
        self.np_scalar = sd["np_scalar"]


def test_scheduler_scaler_data_extras_and_rng_round_trip(ram_root):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    cursor = Cursor()
    for s in range(1, 4):
        _mlp_step(model, opt, s)
        sched.step()
        cursor.pos += 7
        cursor.hist[s] = s * 11
        cursor.loss_ema = np.array(cursor.loss_ema * 0.5 + s)
    cursor.mask[1, 0] = False
    scaler._scale = torch.tensor(512.0)  # as after an overflow
    extras = {"tokens": 1234, "best": [0.5, None], "name": "run"}
    state = memckpt.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                               data={"train": cursor}, extras=extras)
    np.random.seed(5), random.seed(5), torch.manual_seed(5)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    ckpt.step(state, 3)
    want_draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])

    fresh = MLP()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    fsched = torch.optim.lr_scheduler.OneCycleLR(fopt, max_lr=1.0, total_steps=20)
    fscaler = torch.amp.GradScaler("cpu")
    fcursor = Cursor()
    fextras = {"stale": True}
    fstate = memckpt.TrainState(model=fresh, optimizer=fopt, scheduler=fsched, scaler=fscaler,
                                data={"train": fcursor}, extras=fextras)
    assert ckpt.restore(fstate) == 3
    got_draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(got_draws[0], want_draws[0])
    assert np.array_equal(got_draws[1], want_draws[1]) and got_draws[2] == want_draws[2]
    assert fsched.state_dict() == sched.state_dict()
    assert [g["lr"] for g in fopt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert fscaler.state_dict() == scaler.state_dict()
    assert fcursor.pos == 21 and fcursor.window == (21, 24) and fcursor.table == {1: "a", 2: "b"}
    assert isinstance(fcursor.hist, np.ndarray) and fcursor.hist.tolist() == [0, 11, 22, 33]
    assert fcursor.hist.dtype == np.int64
    assert fcursor.loss_ema.shape == () and fcursor.loss_ema == cursor.loss_ema
    assert fcursor.mask.dtype == np.bool_ and fcursor.mask.tolist() == [[True, True], [False, True]]
    assert fstate.extras is fextras and fextras == extras  # replaced in place
    ckpt.close(unlink=True)


def test_load_content_limits_what_is_restored(ram_root):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _mlp_step(model, opt, 1)
    sampler = memckpt.ResumableSampler(10, seed=1)
    it = iter(sampler)
    [next(it) for _ in range(4)]
    state = memckpt.TrainState(model=model, optimizer=opt, data=sampler, extras={"k": 1})
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    ckpt.step(state, 1)
    ckpt.close()

    only_model = memckpt.Checkpointer(memckpt.Config(
        ram_root=ram_root, load=memckpt.LoadSpec(content=("model",))))
    fresh = MLP()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fsampler = memckpt.ResumableSampler(10, seed=1)
    fstate = memckpt.TrainState(model=fresh, optimizer=fopt, data=fsampler, extras={})
    assert only_model.restore(fstate) == 1
    assert_bitwise(fresh.l1.weight, model.l1.weight, "model restored")
    assert fopt.state_dict()["state"] == {} and fsampler.index == 0 and fstate.extras == {}
    only_model.close()

    no_data = memckpt.Checkpointer(memckpt.Config(
        ram_root=ram_root, load=memckpt.LoadSpec(ignore_data_position=True)))
    fsampler2 = memckpt.ResumableSampler(12, seed=1)  # the dataset changed size
    fopt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert no_data.restore(memckpt.TrainState(model=fresh, optimizer=fopt2, data=fsampler2)) == 1
    assert fsampler2.index == 0 and len(fopt2.state) == 8
    with pytest.raises(StateError, match="covers 10 samples, this one 12"):
        memckpt.Checkpointer(memckpt.Config(ram_root=ram_root)).restore(
            memckpt.TrainState(model=fresh, optimizer=fopt2, data=memckpt.ResumableSampler(12)))
    no_data.close(unlink=True)


def test_capture_refuses_what_it_cannot_store_exactly():
    with pytest.raises(StateError, match="extras must be JSON-able"):
        memckpt.TrainState(model=MLP(), extras={"f": object()}).capture(1)

    class Opaque:
        def state_dict(self):
            return {"obj": object()}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(StateError, match="cannot capture object at 'data/d/obj'"):
        memckpt.TrainState(model=MLP(), data={"d": Opaque()}).capture(1)
    with pytest.raises(StateError, match="needs state_dict"):
        memckpt.TrainState(model=MLP(), data=[1, 2, 3])
    with pytest.raises(StateError, match="not a torch.nn.Module"):
        memckpt.TrainState(model={"m": "not a model"})
    with pytest.raises(StateError, match="without '/'"):
        memckpt.TrainState(model={"a/b": MLP()})


def test_flattened_sequences_keep_their_kind_and_every_tensor():
    """Lists and tuples of plain scalars are taken as they are (the RNG states, each step);
    one holding anything else is walked element by element, so its tensors and numpy
    values are still captured."""
    from memckpt.format.state import _Flattener, _unflatten
    tensors: list = []
    flat = _Flattener(tensors)
    obj = {"ints": list(range(700)), "tup": (3, 2.5, "x", None, True),
           "mixed": [1, torch.arange(3), (np.int64(7), 2.0)], "nested": [[1, 2], (3,)]}
    out = flat(obj, "p")
    assert out["ints"] == list(range(700)) and out["tup"] == {"__tuple__": [3, 2.5, "x", None, True]}
    assert out["mixed"] == [1, {"__tensor__": "p/mixed/1"}, {"__tuple__": [7, 2.0]}]
    assert type(out["mixed"][2]["__tuple__"][0]) is int  # the numpy scalar became JSON
    assert out["nested"] == [[1, 2], {"__tuple__": [3]}]
    assert [n for n, _ in tensors] == ["p/mixed/1"]
    back = _unflatten(out, dict(tensors))
    assert back["ints"] == obj["ints"] and back["tup"] == obj["tup"] and back["nested"] == [[1, 2], (3,)]
    assert back["mixed"][0] == 1 and torch.equal(back["mixed"][1], torch.arange(3))
    assert back["mixed"][2] == (7, 2.0)


# ---- ResumableSampler ----------------------------------------------------------------------------

def _take(sampler, n):
    """Consume n indices, cycling epochs like a training loop does."""
    out = []
    while len(out) < n:
        for i in sampler:
            out.append(i)
            if len(out) == n:
                return out
    return out


@pytest.mark.parametrize("stop", [3, 10, 11, 25, 37])
def test_sampler_resumes_mid_epoch_and_across_epochs(stop):
    ref = memckpt.ResumableSampler(10, shuffle=True, seed=4)
    full = _take(ref, 50)
    for e in range(5):  # each epoch is a permutation, and epochs differ
        assert sorted(full[e * 10:(e + 1) * 10]) == list(range(10))
    assert full[:10] != full[10:20]

    first = memckpt.ResumableSampler(10, shuffle=True, seed=4)
    head = _take(first, stop)
    sd = first.state_dict()
    assert sd["epoch"] * 10 + sd["index"] == stop
    second = memckpt.ResumableSampler(10, shuffle=True, seed=4)
    second.load_state_dict(dict(sd))
    assert head + _take(second, 50 - stop) == full


def test_sampler_at_the_end_of_an_epoch_goes_on_to_the_next():
    s = memckpt.ResumableSampler(6, shuffle=True, seed=2)
    it = iter(s)
    epoch0 = [next(it) for _ in range(6)]  # the generator has not noticed the end yet
    sd = s.state_dict()
    assert (sd["epoch"], sd["index"]) == (0, 6)
    r = memckpt.ResumableSampler(6, shuffle=True, seed=2)
    r.load_state_dict(sd)
    assert list(r) == []  # that epoch is finished
    assert (r.epoch, r.index) == (1, 0)
    nxt = list(r)
    assert sorted(nxt) == list(range(6)) and nxt == list(iter(_at_epoch(1)))
    assert epoch0 == list(_at_epoch(0))


def _at_epoch(e):
    s = memckpt.ResumableSampler(6, shuffle=True, seed=2)
    s.epoch = e
    return s


def test_sampler_ranks_partition_and_resume():
    per_rank = []
    for rank in range(3):
        s = memckpt.ResumableSampler(10, shuffle=True, seed=8, rank=rank, world_size=3)
        assert len(s) == 3
        head = _take(s, 2)
        r = memckpt.ResumableSampler(10, shuffle=True, seed=8, rank=rank, world_size=3)
        r.load_state_dict(s.state_dict())
        per_rank.append(head + list(r))
    flat = [i for part in per_rank for i in part]
    assert len(flat) == len(set(flat)) == 9


def test_sampler_unshuffled_and_invalid_arguments():
    s = memckpt.ResumableSampler(5, shuffle=False)
    assert list(s) == [0, 1, 2, 3, 4] and s.epoch == 1
    with pytest.raises(StateError, match="data_len >= 1"):
        memckpt.ResumableSampler(0)
    with pytest.raises(StateError, match="rank < world_size"):
        memckpt.ResumableSampler(10, rank=2, world_size=2)


def test_restore_allocations_are_the_optimizer_state_a_restore_creates():
    from memckpt.format import shard as fmt
    from memckpt.format.state import restore_allocations
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    captured = memckpt.TrainState(model=model, optimizer=opt).capture(1)
    layout = fmt.Layout.of(captured.tensors)
    allocs = restore_allocations(layout)
    want = [(tuple(st[k].shape), st[k].dtype) for st in opt.state.values()
            for k in ("step", "exp_avg", "exp_avg_sq")]
    assert sorted(map(str, allocs)) == sorted(map(str, want))  # no parameter, every moment
    assert restore_allocations(layout, min_bytes=64 * 64 * 4) == [((64, 64), torch.float32)] * 2


def test_a_restore_creates_its_optimizer_state_in_the_pools_tensors(tmp_path):
    """What a worker makes ahead (populate.POOL) is what the restore's optimizer holds,
    with the snapshot's exact values; a tensor of another shape is left alone."""
    from memckpt.format import shard as fmt
    from memckpt.engine.populate import MIN_BYTES, POOL
    from memckpt.format.state import restore_allocations

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 1 MiB weights
        return model, torch.optim.AdamW(model.parameters())

    model, opt = build()
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    state = memckpt.TrainState(model=model, optimizer=opt)
    layout = fmt.Layout.of(state.capture(1).tensors)
    POOL.fill(restore_allocations(layout, MIN_BYTES) + [((3, 3), torch.float64)])
    try:
        POOL.wait()
        made = {t.data_ptr() for ts in POOL._free.values() for t in ts}
        fresh_model, fresh_opt = build()
        _snapshot_and_restore(str(tmp_path), state, memckpt.TrainState(model=fresh_model,
                                                                      optimizer=fresh_opt))
        big = [st[k] for st in fresh_opt.state.values() for k in ("exp_avg", "exp_avg_sq")
               if st[k].numel() * 4 >= MIN_BYTES]
        assert len(big) == 4 and {t.data_ptr() for t in big} <= made
        for p, q in zip(opt.state.values(), fresh_opt.state.values()):
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert_bitwise(p[k], q[k], k)
        assert POOL.take((3, 3), torch.float64) is not None
    finally:
        POOL.clear()
