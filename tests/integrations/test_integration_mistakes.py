"""Mistakes the integrations catch before anything changes (DESIGN.md, "Mistakes users make"):

* a second normalisation: ``reduction="mean"`` given to an integration whose framework already
  divides the loss by the accumulation count (the HF Trainer always; Accelerate when
  ``gradient_accumulation_steps`` > 1; Lightning's automatic optimization) is refused by name,
  at construction, as ``accumulation_steps`` is, saying why and what to pass instead;
  Accelerate with ``gradient_accumulation_steps=1`` divides nothing, and a hand loop with
  ``reduction="mean"`` there stays silent and means what it means natively;
* a misspelt option: "did you mean ...?" at every entry point taking wrapper options (the
  candidates are read from ``AccumulatingOptimizer.__init__``'s signature);
* a bad option value: refused at construction (by the wrapper's own check), not when the
  wrapper is first built inside the framework, after the framework changed things;
* options for an optimizer that is already an ``AccumulatingOptimizer``: refused, never dropped;
* ``AccumulatingTrainer`` with ``gradient_accumulation_steps`` left at 1: one
  ``AccumulationWarning`` naming the fix, none with ``fp32_masters_only=True`` (GA=1 chosen on
  purpose) or with ``warnings.filterwarnings`` on the class.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from accumkernels import AccumulatingOptimizer
from accumkernels import integrations as common
from accumkernels.integrations import AccumulationWarning

WRAPPER_OPTIONS = sorted(
    name for name, p in inspect.signature(AccumulatingOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


# -- the shared check -------------------------------------------------------------------------------

def test_check_options_names_the_option_it_guesses():
    with pytest.raises(TypeError, match="'max_grad_nrom'.*did you mean 'max_grad_norm'"):
        common.check_options({"max_grad_nrom": 1.0})
    with pytest.raises(TypeError, match="'reductoin'.*did you mean 'reduction'"):
        common.check_options({"reductoin": "sum"})
    # a guess that the integration sets itself says so
    with pytest.raises(TypeError, match="did you mean 'accumulation_steps'.*set by the integration"):
        common.check_options({"accumulation_step": 4})
    with pytest.raises(TypeError, match="not an AccumulatingOptimizer argument") as info:
        common.check_options({"zzzzzz": 1})
    assert "did you mean" not in str(info.value)
    with pytest.raises(TypeError, match="names must be strings"):
        common.check_options({1: 2})


def test_check_options_guesses_from_the_wrapper_signature(monkeypatch):
    """The candidates are the wrapper's keyword-only parameters, read, not copied: an option the
    wrapper gains is guessed at once."""

    def init(self, optimizer, *, reduction="sum", brand_new_option=3):
        pass

    monkeypatch.setattr(AccumulatingOptimizer, "__init__", init)
    with pytest.raises(TypeError, match="did you mean 'brand_new_option'"):
        common.check_options({"brand_new_optoin": 1})


@pytest.mark.parametrize("options, match", [
    ({"reduction": "avg"}, "reduction"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"nonfinite": "ignore"}, "nonfinite"),
    ({"master_weights": "yes"}, "master_weights"),
    ({"backend": "cuda13"}, "backend"),
    ({"bucket_size_mb": 0}, "bucket_size_mb"),
])
def test_check_options_checks_values_as_the_wrapper_does(options, match):
    with pytest.raises((TypeError, ValueError), match=match) as ours:
        common.check_options(options)
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(type(ours.value)) as wrapper:
        AccumulatingOptimizer(torch.optim.SGD(params, lr=0.1), **options)
    assert str(ours.value) == str(wrapper.value)


def test_check_options_refuses_a_second_normalisation_by_name():
    who = "the framework divides the loss by N"
    with pytest.raises(ValueError, match="reduction='mean'.*divides the loss by N.*'sum'"):
        common.check_options({"reduction": "mean"}, normalised_by=who)
    assert common.check_options({"reduction": "sum"}, normalised_by=who) == {"reduction": "sum"}
    assert common.check_options({"reduction": "mean"}) == {"reduction": "mean"}


def test_accumulation_warning_is_one_user_warning_class_for_wrapper_and_integrations():
    """One filter silences every accumkernels setup warning, wherever it was raised."""
    import accumkernels.optim
    assert issubclass(AccumulationWarning, UserWarning)
    assert AccumulationWarning is accumkernels.optim.AccumulationWarning


# -- HF Trainer -------------------------------------------------------------------------------------

transformers_only = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("transformers"), reason="needs transformers")


def _trainer(tmp_path, ga: int = 1, **kwargs):
    from transformers import TrainingArguments

    from accumkernels.integrations.transformers import AccumulatingTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             gradient_accumulation_steps=ga)
    return AccumulatingTrainer(model=torch.nn.Linear(3, 1), args=args, **kwargs)


@pytest.fixture
def fresh_state():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@transformers_only
def test_trainer_refuses_reduction_mean_before_it_is_built(tmp_path, fresh_state):
    from accelerate.state import AcceleratorState

    with pytest.raises(ValueError, match="reduction='mean'.*gradient_accumulation_steps.*'sum'"):
        _trainer(tmp_path, ga=4, accumkernels={"reduction": "mean"})
    assert not AcceleratorState._shared_state  # refused before the Trainer built its Accelerator
    trainer = _trainer(tmp_path, ga=4, accumkernels={"reduction": "sum"})
    assert trainer.create_optimizer().config.reduction == "sum"


@transformers_only
def test_trainer_did_you_mean_and_values_checked_first(tmp_path, fresh_state):
    from accelerate.state import AcceleratorState

    with pytest.raises(TypeError, match="'max_grad_nrom'.*did you mean 'max_grad_norm'"):
        _trainer(tmp_path, ga=4, accumkernels={"max_grad_nrom": 1.0})
    with pytest.raises(ValueError, match="nonfinite"):
        _trainer(tmp_path, ga=4, accumkernels={"nonfinite": "ignore"})
    assert not AcceleratorState._shared_state


@transformers_only
def test_trainer_with_ga_one_warns_once_naming_the_fix(tmp_path, fresh_state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, ga=1)
    ours = [w for w in caught if issubclass(w.category, AccumulationWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "gradient_accumulation_steps" in message and "fp32_masters_only=True" in message
    assert "AccumulationWarning" in message  # the other documented way to silence it
    assert ours[0].filename == __file__  # points at the user's line (here: _trainer)


@transformers_only
def test_trainer_silent_with_accumulation_or_ga_one_on_purpose(tmp_path, fresh_state):
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccumulationWarning)
        _trainer(tmp_path, ga=4)
        _trainer(tmp_path, ga=1, fp32_masters_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=AccumulationWarning)
        _trainer(tmp_path, ga=1)
    assert not [w for w in caught if issubclass(w.category, AccumulationWarning)]


@transformers_only
def test_trainer_fp32_masters_only_with_accumulation_is_refused(tmp_path, fresh_state):
    from accelerate.state import AcceleratorState

    with pytest.raises(ValueError, match="fp32_masters_only=True.*gradient_accumulation_steps=4"):
        _trainer(tmp_path, ga=4, fp32_masters_only=True)
    assert not AcceleratorState._shared_state
    with pytest.raises(TypeError, match="fp32_masters_only must be a bool"):
        _trainer(tmp_path, ga=1, fp32_masters_only="yes")


@transformers_only
def test_trainer_refuses_options_for_an_optimizer_already_wrapped(tmp_path, fresh_state):
    """``optimizers=(wrapper, None)`` or a by-name class through ``optimizer_cls_and_kwargs`` take
    their options where they are built: the Trainer's ``accumkernels`` would be dropped."""
    from accelerate.state import AcceleratorState

    import accumkernels.optimizers as by_name

    model = torch.nn.Linear(3, 1)
    wrapper = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer.*max_grad_norm"):
        _trainer(tmp_path, ga=4, optimizers=(wrapper, None), accumkernels={"max_grad_norm": 1.0})
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer.*max_grad_norm"):
        _trainer(tmp_path, ga=4, optimizer_cls_and_kwargs=(by_name.SGD, {"lr": 0.1}),
                 accumkernels={"max_grad_norm": 1.0})
    assert not AcceleratorState._shared_state
    assert wrapper.config.max_grad_norm is None
    trainer = _trainer(tmp_path, ga=4, optimizer_cls_and_kwargs=(by_name.SGD, {"lr": 0.1}))
    assert type(trainer.create_optimizer()) is by_name.SGD


# -- Accelerate -------------------------------------------------------------------------------------

def _accelerator(**kwargs):
    pytest.importorskip("accelerate")
    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    return AccumulatingAccelerator(cpu=True, **kwargs)


def test_accelerate_refuses_reduction_mean_where_it_divides(fresh_state, monkeypatch):
    from accelerate.state import AcceleratorState
    from accelerate.utils import GradientAccumulationPlugin

    mean = {"accumkernels": {"reduction": "mean"}}
    with pytest.raises(ValueError, match="reduction='mean'.*gradient_accumulation_steps=4.*'sum'"):
        _accelerator(gradient_accumulation_steps=4, **mean)
    with pytest.raises(ValueError, match="reduction='mean'"):
        _accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3), **mean)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    with pytest.raises(ValueError, match="reduction='mean'"):
        _accelerator(**mean)
    assert not AcceleratorState._shared_state  # refused before Accelerate built its state


def test_accelerate_refuses_mean_when_accumulation_is_turned_on_later(fresh_state):
    """``accelerator.gradient_accumulation_steps = 4`` after construction: refused at
    ``prepare``, before anything is prepared or wrapped."""
    accelerator = _accelerator(accumkernels={"reduction": "mean"})
    accelerator.gradient_accumulation_steps = 4
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="reduction='mean'.*gradient_accumulation_steps=4"):
        accelerator.prepare(model, inner)
    with pytest.raises(ValueError, match="reduction='mean'"):
        accelerator.prepare_optimizer(inner)
    assert not accelerator._models and not accelerator._optimizers
    assert common.inner_wrapper(inner) is None


def test_accelerate_mean_with_ga_one_is_a_hand_loop_and_stays_silent(fresh_state):
    """GA=1: Accelerate divides nothing; a hand loop of 3 backwards per step with
    ``reduction="mean"`` steps on the mean gradient, as native with ``loss / 3`` does."""
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 2)
    data = [torch.randn(5, 4) for _ in range(3)]
    native = torch.nn.Linear(4, 2)
    native.load_state_dict(start.state_dict())
    native_opt = torch.optim.SGD(native.parameters(), lr=0.1)
    for x in data:
        (native(x).square().sum() / 3).backward()
    native_opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", AccumulationWarning)
        accelerator = _accelerator(accumkernels={"reduction": "mean"})
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(start.state_dict())
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x in data:
        accelerator.backward(model(x).square().sum())
    opt.step()
    for p, q in zip(model.parameters(), native.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_accelerate_did_you_mean_and_values_checked_first(fresh_state):
    from accelerate.state import AcceleratorState

    with pytest.raises(TypeError, match="'master_weight'.*did you mean 'master_weights'"):
        _accelerator(accumkernels={"master_weight": True})
    with pytest.raises(ValueError, match="max_grad_norm"):
        _accelerator(accumkernels={"max_grad_norm": -1.0})
    assert not AcceleratorState._shared_state


def test_accelerate_refuses_options_for_an_optimizer_already_wrapped(fresh_state):
    accelerator = _accelerator(accumkernels={"max_grad_norm": 1.0})
    model = torch.nn.Linear(3, 2)
    wrapper = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer.*max_grad_norm"):
        accelerator.prepare(model, wrapper)
    assert not accelerator._models and not accelerator._optimizers
    assert wrapper.config.max_grad_norm is None
    plain = _accelerator()  # no options: the wrapper is kept as it is
    _, prepared = plain.prepare(model, wrapper)
    assert common.inner_wrapper(prepared) is wrapper


# -- Lightning --------------------------------------------------------------------------------------

def _callback(**options):
    pytest.importorskip("lightning")
    from accumkernels.integrations.lightning import FP32Accumulation

    return FP32Accumulation(**options)


def test_lightning_refuses_reduction_mean_at_construction():
    with pytest.raises(ValueError, match="reduction='mean'.*accumulate_grad_batches.*'sum'"):
        _callback(reduction="mean")
    assert _callback(reduction="sum").options == {"reduction": "sum"}


def test_lightning_did_you_mean_and_values_at_construction():
    with pytest.raises(TypeError, match="'nonfinte'.*did you mean 'nonfinite'"):
        _callback(nonfinte="raise")
    with pytest.raises(ValueError, match="reduction"):
        _callback(reduction="avg")  # refused here, not at on_fit_start after Lightning's setup


def test_lightning_refuses_options_for_an_optimizer_already_wrapped():
    """``configure_optimizers`` returns a wrapper and the callback was given options: refused at
    ``on_fit_start`` before any optimizer is wrapped, the wrapper unchanged."""
    pytest.importorskip("lightning")
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.opt = None

        def training_step(self, batch, batch_idx):
            return self.layer(batch).square().mean()

        def configure_optimizers(self):
            self.opt = AccumulatingOptimizer(torch.optim.SGD(self.layer.parameters(), lr=0.1))
            return self.opt

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[_callback(max_grad_norm=1.0)])
    loader = torch.utils.data.DataLoader(torch.randn(4, 3), batch_size=2)
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer.*max_grad_norm"):
        trainer.fit(module, loader)
    assert module.opt.config.max_grad_norm is None


# -- Fabric -----------------------------------------------------------------------------------------

def test_fabric_setup_says_did_you_mean():
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    from accumkernels.integrations.fabric import setup

    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match="'bucket_size'.*did you mean 'bucket_size_mb'"):
        setup(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_size=10)
