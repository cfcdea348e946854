"""What was tuned, in words: the optimizer, loss and dtype policy the capture recorded
(``rewriter.trace.training_setup``, in ``graph.meta["training"]``), for the report and the command line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # TensorFlow only when a plan is applied
    from rewriter.trace.step_inputs import StepInputs


def training_phrase(training: dict[str, Any] | None) -> str:
    """``optimizer Adam (learning rate 0.001; beta_1 0.9, ...), loss mse, dtype policy float32``."""
    if not training:
        return "not recorded (a hand-written step)"
    loss = training.get("loss")
    return (f"optimizer {optimizer_phrase(training.get('optimizer'))}, loss {_loss_phrase(loss)}, "
            f"dtype policy {training.get('dtype_policy')}")


def _loss_phrase(loss: Any) -> str:
    if loss is None:
        return "none compiled (the model's train_step computes its own)"
    if isinstance(loss, dict):
        return "{" + ", ".join(f"{key}: {_loss_phrase(value)}" for key, value in loss.items()) + "}"
    if isinstance(loss, list):
        return "[" + ", ".join(_loss_phrase(value) for value in loss) + "]"
    return str(loss)


def optimizer_phrase(optimizer: dict[str, Any] | None) -> str:
    """``describe_optimizer``'s answer in words: ``Adam (learning rate 0.001; beta_1 0.9, ...)``."""
    if optimizer is None:
        return "none"
    if "inner" in optimizer:
        inner = optimizer["inner"]
        scale = _settings_phrase(optimizer["settings"], "")
        return f"{optimizer['class']} around {optimizer_phrase(inner)}" + (f" ({scale})" if scale else "")
    return f"{optimizer['class']} (learning rate {optimizer['learning_rate']}{_settings_phrase(optimizer['settings'], '; ')})"


def _settings_phrase(settings: dict[str, Any], lead: str = " ") -> str:
    """The settings that are on (None and False left out), ``name value``."""
    shown = [f"{key} {value}" for key, value in settings.items() if value not in (None, False)
             and not (key == "ema_momentum" and not settings.get("use_ema"))]
    return (lead + ", ".join(shown)) if shown else ""


def fit_weights_note(model, plan, batch_size: int, inputs: StepInputs) -> str | None:
    """Why ``model.fit`` cannot pass ``class_weight`` or ``sample_weight`` with ``plan`` (None: it can):
    a weighted batch runs the plan applied to the step traced with a weight per sample (``rewriter.step.keras_fit``),
    which a ``train_step`` of the model's own may not take, or whose ops may differ from the plan's."""
    from rewriter.step.apply_plan import apply

    try:
        apply(model, plan, batch_size=batch_size, verify=False, sample_weight=True, inputs=inputs)
    except Exception as error:  # noqa: BLE001 -- whatever tracing or applying raised is the reason
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        return (f"model.fit with class_weight or sample_weight cannot use this plan: the training step with a weight "
                f"per sample could not take it ({type(error).__name__}: {reason}); train without them, or with a "
                "plain model.fit")
    return None
