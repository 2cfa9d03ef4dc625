"""Optimizers by name (accumkernels.optimizers, ``accumulating``): every ``torch.optim`` optimizer
as a class a config names and calls as ``Cls(params, lr=..., <wrapper options>)``.

* Each class builds an ``AccumulatingOptimizer`` over its torch optimizer and steps what native
  accumulation steps (fp32, bit for bit, several windows); pickling, ``deepcopy`` and state
  dicts keep the class; the signature shows the optimizer's parameters then the wrapper's.
* An unknown keyword is refused by name before anything is built; a wrapper option that the
  inner optimizer also takes is spelt ``wrapper_<name>``; ``accumulating`` names its class like
  ``namedtuple`` does, so user classes pickle.
* The config paths, each through the real library: Hydra's ``instantiate`` (``_target_``,
  ``_partial_``), jsonargparse's class-path parsing and LightningCLI (``--optimizer``,
  ``class_path``/``init_args``: the whole fit against native, bit for bit), ``functools.partial``,
  the HF Trainer's ``optimizer_cls_and_kwargs``; litgpt's ``instantiate_torch_optimizer`` and
  torchtune's ``config.instantiate`` (``_component_``) where those are installed (``make
  clients``: tests/integrations/test_clients.py runs the whole entry points).
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle

import pytest
import torch

import accumkernels.optimizers as by_name
from accumkernels import AccumulatingOptimizer, accumulating

try:  # the Accelerate singletons reset around the Trainer test
    from _integrations_common import fresh_accelerate_state  # noqa: F401
except pytest.skip.Exception:  # transformers missing: that test skips
    pass

# per optimizer: the inner arguments a window of fp32 sums steps with (defaults elsewhere)
KWARGS = {"SGD": {"lr": 0.1, "momentum": 0.9}, "LBFGS": {"lr": 0.5}, "Muon": {"lr": 0.02},
          "Adafactor": {"lr": 0.01}}
REFUSED = {"SparseAdam": "sparse"}  # refused at construction by the wrapper, naming why


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # no biases: Muon takes 2-D params only
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4, bias=False))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _train(model, opt, windows: int = 3, n: int = 3) -> None:
    data = _batches(windows * n)
    for w in range(windows):
        def closure(w=w):
            opt.zero_grad()
            loss = sum(model(x).square().mean() / n for x in data[w * n:(w + 1) * n])
            loss.backward()
            return loss
        if isinstance(opt, torch.optim.LBFGS) or getattr(opt, "inner_class", None) is \
                torch.optim.LBFGS:
            opt.step(closure)
            continue
        for x in data[w * n:(w + 1) * n]:
            (model(x).square().mean() / n).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", by_name.TORCH_OPTIMIZERS)
def test_every_torch_optimizer_by_name_steps_as_native(name):
    """``accumkernels.optimizers.<Name>(params, **kwargs)`` wraps ``torch.optim.<Name>`` and
    ends where native accumulation does (fp32, bit for bit); SparseAdam is refused by name."""
    cls = getattr(by_name, name)
    assert issubclass(cls, AccumulatingOptimizer) and cls.inner_class is getattr(torch.optim, name)
    assert (cls.__module__, cls.__qualname__) == ("accumkernels.optimizers", name)
    kwargs = KWARGS.get(name, {"lr": 0.01})
    ours_model = _model()
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            cls(ours_model.parameters(), **kwargs)
        return
    ours = cls(ours_model.parameters(), **kwargs)
    assert isinstance(ours, torch.optim.Optimizer) and type(ours.optimizer) is cls.inner_class
    native_model = _model()
    _train(native_model, getattr(torch.optim, name)(native_model.parameters(), **kwargs))
    _train(ours_model, ours)
    for p, q in zip(native_model.parameters(), ours_model.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(_model().state_dict()["0.weight"], ours_model.state_dict()["0.weight"])


def test_signature_lists_optimizer_then_wrapper_options():
    """What litgpt's and jsonargparse's introspection read: the inner parameters, then the
    wrapper's options as annotated keyword-only parameters with the wrapper's defaults."""
    params = inspect.signature(by_name.AdamW).parameters
    inner = list(inspect.signature(torch.optim.AdamW).parameters)
    assert list(params)[:len(inner)] == inner
    for option, default in (("accumulation_steps", None), ("reduction", "sum"),
                            ("master_weights", "auto"), ("max_grad_norm", None),
                            ("nonfinite", "skip_step"), ("loss_scale", None)):
        assert params[option].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[option].default == default
        assert params[option].annotation is not inspect.Parameter.empty
    assert "model" not in params and "process_group" not in params


def test_options_reach_the_wrapper_and_bad_ones_are_refused_by_name():
    model = _model()
    opt = by_name.SGD(model.parameters(), lr=0.1, momentum=0.9, accumulation_steps=4,
                      reduction="mean", max_grad_norm=1.0, nonfinite="raise")
    assert (opt.accumulation_steps, opt.reduction, opt.max_grad_norm, opt.nonfinite) == \
        (4, "mean", 1.0, "raise")
    assert opt.optimizer.defaults["momentum"] == 0.9
    with pytest.raises(TypeError, match="'reductoin' .*did you mean 'reduction'"):
        by_name.AdamW(_model().parameters(), lr=1e-3, reductoin="sum")
    with pytest.raises(TypeError, match="'max_norm'"):
        by_name.AdamW(_model().parameters(), max_norm=1.0)
    with pytest.raises(ValueError, match="reduction"):
        by_name.AdamW(_model().parameters(), reduction="avg")
    with pytest.raises(TypeError):
        accumulating(torch.nn.Linear)
    with pytest.raises(TypeError, match="already"):
        accumulating(by_name.AdamW)


def test_pickle_deepcopy_and_state_dict_keep_the_class():
    model = _model()
    opt = by_name.AdamW(model.parameters(), lr=0.01, accumulation_steps=3, reduction="mean")
    for x in _batches(2):  # mid-window: the window travels too
        model(x).square().mean().backward()
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(copied) is by_name.AdamW
        assert (copied.accumulation_steps, copied.reduction) == (3, "mean")
        assert copied.micro_steps == 2
    sd = opt.state_dict()
    fresh_model = _model()
    fresh = by_name.AdamW(fresh_model.parameters(), lr=0.01, accumulation_steps=3,
                          reduction="mean")
    fresh.load_state_dict(sd)
    assert fresh.micro_steps == 2
    native = torch.optim.AdamW(_model().parameters(), lr=0.01)
    native.load_state_dict(torch.optim.AdamW(_model().parameters(), lr=0.01).state_dict())
    fresh.load_state_dict(native.state_dict())  # a native state dict loads, as into the wrapper


class WithClip(torch.optim.SGD):
    """An optimizer that takes one of the wrapper's option names itself."""

    def __init__(self, params, lr=0.1, max_grad_norm=None):
        super().__init__(params, lr=lr)
        self.own_clip = max_grad_norm


AccumulatingWithClip = accumulating(WithClip, name="AccumulatingWithClip")


def test_factory_names_its_class_and_spells_colliding_options():
    """``accumulating`` gives one class per (optimizer, name, module), named in the caller's
    module (pickle finds it); an option the optimizer takes itself keeps its meaning there and
    the wrapper's is spelt ``wrapper_<name>``."""
    assert accumulating(WithClip, name="AccumulatingWithClip") is AccumulatingWithClip
    assert AccumulatingWithClip.__module__ == __name__
    params = inspect.signature(AccumulatingWithClip).parameters
    assert "max_grad_norm" in params and "wrapper_max_grad_norm" in params
    opt = AccumulatingWithClip(_model().parameters(), lr=0.1, max_grad_norm=5.0,
                               wrapper_max_grad_norm=1.0)
    assert opt.optimizer.own_clip == 5.0 and opt.config.max_grad_norm == 1.0
    assert type(pickle.loads(pickle.dumps(opt))) is AccumulatingWithClip


class TakesAny(torch.optim.SGD):
    """An optimizer whose extra options arrive through ``**kwargs``."""

    def __init__(self, params, lr=0.1, **kwargs):
        super().__init__(params, lr=lr, momentum=kwargs.pop("momentum", 0.0))
        self.extra = kwargs


AccumulatingTakesAny = accumulating(TakesAny, name="AccumulatingTakesAny")


def test_factory_with_var_keyword_optimizer():
    """An optimizer taking ``**kwargs``: the wrapper's options are taken out by name, every
    other keyword reaches the optimizer; the signature keeps ``**kwargs`` last."""
    params = list(inspect.signature(AccumulatingTakesAny).parameters.values())
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    opt = AccumulatingTakesAny(_model().parameters(), 0.2, momentum=0.5, anything=1,
                               reduction="mean")
    assert opt.reduction == "mean" and opt.optimizer.extra == {"anything": 1}
    assert opt.optimizer.defaults["lr"] == 0.2 and opt.optimizer.defaults["momentum"] == 0.5


# -- the config paths, through the real libraries ---------------------------------------------------
def test_hydra_instantiate_target():
    """Hydra: ``_target_`` with the params given at the call, and ``_partial_: true`` (a
    ``functools.partial`` the training code calls with the params)."""
    pytest.importorskip("hydra")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create("""
    optimizer:
      _target_: accumkernels.optimizers.AdamW
      lr: 1.0e-3
      betas: [0.9, 0.95]
      reduction: mean
      max_grad_norm: 1.0
    factory:
      _target_: accumkernels.optimizers.SGD
      _partial_: true
      lr: 0.1
      accumulation_steps: 4
    """)
    opt = instantiate(cfg.optimizer, params=_model().parameters())
    assert type(opt) is by_name.AdamW and opt.reduction == "mean" and opt.max_grad_norm == 1.0
    assert tuple(opt.defaults["betas"]) == (0.9, 0.95)
    factory = instantiate(cfg.factory)
    assert isinstance(factory, functools.partial)
    opt = factory(_model().parameters())
    assert type(opt) is by_name.SGD and opt.accumulation_steps == 4
    bad = OmegaConf.create({"_target_": "accumkernels.optimizers.AdamW", "reductoin": "sum"})
    with pytest.raises(Exception, match="reductoin"):
        instantiate(bad, params=_model().parameters())


def test_functools_partial_and_trainer_optimizer_cls_and_kwargs():
    """``functools.partial`` factories, and the (class, kwargs) pair the HF Trainer's
    ``optimizer_cls_and_kwargs`` calls as ``cls(params, **kwargs)``."""
    make = functools.partial(by_name.AdamW, lr=1e-3, reduction="mean")
    assert type(make(_model().parameters())) is by_name.AdamW
    cls, kwargs = by_name.AdamW, {"lr": 1e-3, "max_grad_norm": 1.0}
    assert cls(_model().parameters(), **kwargs).max_grad_norm == 1.0


def _trainer_run(tmp_path, optimizer_cls) -> list[torch.Tensor]:
    from _integrations_common import (
        ACCUM,
        CLIP,
        LR,
        MICRO,
        TokenDataset,
        oneline_gpt2,
        snapshot,
        token_samples,
    )
    from transformers import Trainer, TrainingArguments

    model = oneline_gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_grad_norm=CLIP, num_train_epochs=1, save_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(token_samples(1)),
                      optimizer_cls_and_kwargs=(optimizer_cls, {"lr": LR}))
    trainer.train()
    return snapshot(model), trainer.optimizer.optimizer


def test_hf_trainer_optimizer_cls_and_kwargs_equals_native(tmp_path, fresh_accelerate_state):
    """The HF Trainer's ``optimizer_cls_and_kwargs=(accumkernels.optimizers.AdamW, {...})``:
    the Trainer builds its weight-decay groups and calls the class; one epoch of windows 4, 4, 2
    with ``max_grad_norm`` ends bit for bit where ``(torch.optim.AdamW, {...})`` does."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    native, native_opt = _trainer_run(tmp_path / "native", torch.optim.AdamW)
    ours, ours_opt = _trainer_run(tmp_path / "ours", by_name.AdamW)
    assert type(ours_opt) is by_name.AdamW and type(native_opt) is torch.optim.AdamW
    assert len(ours_opt.param_groups) == 2  # the Trainer's decay / no-decay groups
    for p, q in zip(native, ours):
        assert torch.equal(p, q)


def test_jsonargparse_class_path_and_command_line():
    """jsonargparse (LightningCLI's and litgpt's parser): ``--optimizer`` with a class path and
    dotted init args, a YAML ``class_path``/``init_args``; a bad value is refused by name."""
    jsonargparse = pytest.importorskip("jsonargparse")

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(torch.optim.Optimizer, "optimizer", skip={"params"},
                                  instantiate=False)
    cfg = parser.parse_args(["--optimizer=accumkernels.optimizers.AdamW",
                             "--optimizer.lr=0.01", "--optimizer.reduction=mean",
                             "--optimizer.accumulation_steps=4",
                             "--optimizer.max_grad_norm=1.0"])
    init = cfg.optimizer.init_args
    assert (init.lr, init.reduction, init.accumulation_steps, init.max_grad_norm) == \
        (0.01, "mean", 4, 1.0)
    cfg = parser.parse_string("optimizer:\n  class_path: accumkernels.optimizers.SGD\n"
                              "  init_args: {lr: 0.1, nonfinite: raise}\n")
    assert cfg.optimizer.init_args.nonfinite == "raise"
    with pytest.raises(jsonargparse.ArgumentError, match="reduction"):
        parser.parse_args(["--optimizer=accumkernels.optimizers.AdamW",
                           "--optimizer.reduction=avg"])


def _cli_fit(tmp_path, optimizer_args: list[str]) -> list[torch.Tensor]:
    from _lightning_cli_module import TinyRegression
    from lightning.pytorch.cli import LightningCLI

    args = ["--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.max_epochs=2", "--trainer.accumulate_grad_batches=3",
            "--trainer.gradient_clip_val=0.05", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",
            *optimizer_args]
    cli = LightningCLI(TinyRegression, args=args, run=False, save_config_kwargs={
        "overwrite": True})
    cli.trainer.fit(cli.model)
    return cli.model, cli.trainer.optimizers[0]


def test_lightning_cli_optimizer_by_name_equals_native(tmp_path):
    """LightningCLI: ``--optimizer accumkernels.optimizers.AdamW`` (and a config file's
    ``class_path``/``init_args``) fits bit for bit like ``--optimizer torch.optim.AdamW``, with
    ``accumulate_grad_batches=3`` (windows 3, 3, 2 per epoch) and ``gradient_clip_val``."""
    pytest.importorskip("jsonargparse")
    pytest.importorskip("lightning")
    native, native_opt = _cli_fit(tmp_path / "native", [
        "--optimizer=torch.optim.AdamW", "--optimizer.lr=0.01"])
    ours, ours_opt = _cli_fit(tmp_path / "ours", [
        "--optimizer=accumkernels.optimizers.AdamW", "--optimizer.lr=0.01",
        "--optimizer.reduction=sum"])
    config = tmp_path / "optimizer.yaml"
    config.write_text("optimizer:\n  class_path: accumkernels.optimizers.AdamW\n"
                      "  init_args:\n    lr: 0.01\n    accumulation_steps: null\n")
    from_file, _ = _cli_fit(tmp_path / "file", [f"--config={config}"])
    assert isinstance(ours_opt, by_name.AdamW)
    assert not isinstance(native_opt, AccumulatingOptimizer)
    for p, q, r in zip(native.parameters(), ours.parameters(), from_file.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)
    assert not torch.equal(next(native.parameters()), next(ours.parameters()) * 0)


def test_lightning_cli_ddp_two_ranks_by_name_equals_native(tmp_path):
    """LightningCLI with ``--trainer.strategy=ddp`` on 2 gloo ranks: ``--optimizer
    accumkernels.optimizers.AdamW`` with ``--trainer.callbacks+=...FP32Accumulation`` (the comm
    hook) fits bit for bit like ``--optimizer torch.optim.AdamW``; without the callback the
    first step is refused, naming the comm hook."""
    pytest.importorskip("jsonargparse")
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")  # _integrations_common
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from _cli_workers import run_cli_ranks

    results = run_cli_ranks(tmp_path)
    for rank, res in enumerate(results):
        assert res["by_name"].get("optimizer") == "accumkernels.optimizers.AdamW", res["by_name"]
        for p, q in zip(res["native"]["params"], res["by_name"]["params"]):
            assert torch.equal(p, q), f"rank {rank}"
        for p, q in zip(res["by_name"]["params"], results[0]["by_name"]["params"]):
            assert torch.equal(p, q), f"rank {rank} differs from rank 0"
        assert "ddp_comm_hook" in res["no_callback"]["error"], res["no_callback"]


def test_litgpt_instantiate_torch_optimizer():
    """litgpt's ``--optimizer`` / ``optimizer.class_path`` (litgpt.utils.instantiate_torch_
    optimizer): a class path with ``init_args`` and a dotted name alone, litgpt's own extra
    keywords kept only where the signature names them."""
    utils = pytest.importorskip("litgpt.utils")
    opt = utils.instantiate_torch_optimizer(
        {"class_path": "accumkernels.optimizers.AdamW",
         "init_args": {"lr": 1e-3, "weight_decay": 0.1, "reduction": "mean"}},
        _model().parameters(), fused=False)
    assert type(opt) is by_name.AdamW and opt.reduction == "mean"
    assert opt.optimizer.defaults["weight_decay"] == 0.1
    # ``--optimizer accumkernels.optimizers.AdamW``: a dotted name, the class's defaults
    opt = utils.instantiate_torch_optimizer("accumkernels.optimizers.AdamW",
                                            _model().parameters(), fused=False)
    assert type(opt) is by_name.AdamW and opt.reduction == "sum"


def test_torchtune_component():
    """torchtune's ``config.instantiate`` of an ``optimizer: {_component_: ...}`` section."""
    pytest.importorskip("torchtune")
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create({"_component_": "accumkernels.optimizers.AdamW", "lr": 2e-5,
                            "fused": False, "max_grad_norm": 1.0})
    opt = config.instantiate(cfg, _model().parameters())
    assert type(opt) is by_name.AdamW and opt.max_grad_norm == 1.0


# -- accumulating()'s own arguments -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"name": 123}, TypeError, "name must be a str.*int"),
    ({"name": b"SGD"}, TypeError, "name must be a str.*bytes"),
    ({"name": ""}, ValueError, "name must be an identifier"),
    ({"name": "not valid"}, ValueError, "name must be an identifier"),
    ({"name": "class"}, ValueError, "keyword"),
    ({"module": 123}, TypeError, "module must be a str.*int"),
    ({"module": ["m"]}, TypeError, "module must be a str.*list"),
    ({"module": ""}, ValueError, "module must be a dotted module name"),
    ({"module": "a..b"}, ValueError, "module must be a dotted module name"),
])
def test_accumulating_refuses_bad_name_and_module_by_argument(kwargs, error, match):
    """What namedtuple refuses, refused by the argument's name, before any class is made."""
    with pytest.raises(error, match=match):
        accumulating(torch.optim.SGD, **kwargs)


def test_accumulating_accepts_dotted_modules_and_names():
    cls = accumulating(torch.optim.SGD, name="PlainSGD", module="my_pkg.optim")
    assert (cls.__module__, cls.__qualname__, cls.__name__) == ("my_pkg.optim", "PlainSGD",
                                                                 "PlainSGD")
    assert accumulating(torch.optim.SGD, name="PlainSGD", module="my_pkg.optim") is cls


class TakesBothSpellings(torch.optim.SGD):
    """An optimizer with its own ``max_grad_norm`` and ``wrapper_max_grad_norm``: the by-name
    class could spell the wrapper's option neither way."""

    def __init__(self, params, lr=0.1, max_grad_norm=None, wrapper_max_grad_norm=None):
        super().__init__(params, lr=lr)


class TakesBothKeywordOnly(torch.optim.SGD):
    def __init__(self, params, lr=0.1, *, reduction=None, wrapper_reduction=None):
        super().__init__(params, lr=lr)


@pytest.mark.parametrize("cls, option", [(TakesBothSpellings, "max_grad_norm"),
                                         (TakesBothKeywordOnly, "reduction")])
def test_accumulating_refuses_both_spellings_saying_why(cls, option):
    with pytest.raises(TypeError) as info:
        accumulating(cls)
    message = str(info.value)
    assert f"'{option}'" in message and f"'wrapper_{option}'" in message, message
    assert "no keyword would reach the wrapper's" in message, message
    assert f"AccumulatingOptimizer({cls.__name__}(params, ...), {option}=...)" in message, message
