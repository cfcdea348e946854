"""The user's own code and model: ``--import`` modules, loading the model, what it means for the tool.

Models with custom layers, losses or subclassed models need the code that defines them imported before
Keras loads the file (``--import MODULE`` or ``imports = [...]`` in autotune.toml). A module name is
looked up in the model's directory first, then on the Python path; a path to a ``.py`` file works too
(relative to the model's directory, else to the current one). Names are checked before anything slow
happens (``resolve_imports``); the modules are imported by ``load_user_model``, just before the model.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from autotune.inputs import InputError, load_model

# where Keras says a function came from when it was defined in the running script, not in a module
SCRIPT_MODULES = ("builtins", "__main__")
IMPORT_HINT = "import the code that defines it with --import MODULE (or imports = [\"MODULE\"] in autotune.toml)"


@dataclass(frozen=True)
class UserImport:
    """One ``--import`` entry: as the user wrote it, where (flag or file), and the file when it is a path."""

    entry: str
    where: str
    path: Path | None = None


def resolve_imports(entries: list[tuple[str, str]], model_dir: Path) -> list[UserImport]:
    """``(entry, where)`` pairs -> ``UserImport``s; an entry that names nothing is an ``InputError``."""
    resolved = []
    for entry, where in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise InputError(f"{where}: expected a module name or a .py file, got {entry!r}")
        entry = entry.strip()
        if entry.endswith(".py") or "/" in entry or "\\" in entry:
            candidates = [Path(entry)] if Path(entry).is_absolute() else [model_dir / entry, Path.cwd() / entry]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None or found.suffix != ".py":
                raise InputError(f"{where} {entry}: no such .py file (looked in {model_dir} and the current directory)")
            resolved.append(UserImport(entry, where, found.resolve()))
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", entry):
            raise InputError(f"{where} {entry!r}: not a module name (e.g. my_layers or pkg.layers) or a .py file")
        top = entry.split(".")[0]
        local = (model_dir / f"{top}.py").is_file() or (model_dir / top).is_dir()
        if not local and importlib.util.find_spec(top) is None:
            raise InputError(f"{where} {entry}: no module {top!r} in {model_dir} or on the Python path")
        resolved.append(UserImport(entry, where))
    return resolved


def import_user_code(imports: list[UserImport], model_dir: Path) -> None:
    """Import each module (the model's directory first on the path); a failure is one ``InputError``."""
    if imports and str(model_dir) not in sys.path:
        sys.path.insert(0, str(model_dir))
    for item in imports:
        try:
            if item.path is None:
                importlib.import_module(item.entry)
            else:
                _import_file(item.path)
        except Exception as error:  # the user's module raised: name it, with its own message
            text = " ".join(str(error).split())[:300]
            raise InputError(f"{item.where} {item.entry}: importing it failed: {type(error).__name__}: {text}") \
                from None


def _import_file(path: Path) -> None:
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def check_model_archive(path: Path) -> None:
    """A ``.keras`` file is a zip archive with a config.json: say so when it is not (Keras would say
    'File not found' for a file that exists)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
    if head.startswith(b"\x89HDF"):
        raise InputError(f"{path} is an HDF5 (.h5) model renamed to .keras: load it with keras.models.load_model "
                         "from its .h5 name and save it again as .keras")
    if not zipfile.is_zipfile(path):
        raise InputError(f"{path} is not a Keras model archive (a .keras file is a zip archive): it is truncated "
                         "or corrupt, or another kind of file renamed to .keras")
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError) as error:
        raise InputError(f"{path} is a corrupt .keras archive: {error}") from None
    if "config.json" not in names:
        raise InputError(f"{path} is a zip archive but not a Keras model (no config.json in it)")


def describe_load_error(error: BaseException) -> str:
    """Keras' message for a model it cannot rebuild, on one line, naming the missing class or function
    and the module it came from, with the hint to import it."""
    text = str(error).strip()
    missing = re.search(r"Could not locate (class|function) '([^']+)'", text)
    if missing:
        module = re.search(r"Full object config: \{'module': '([^']+)'", text)
        user_module = module.group(1) if module and not module.group(1).startswith("keras") else None
        if user_module in SCRIPT_MODULES:  # no import can provide it: a module that registers the name can
            name = missing.group(2)
            return (f"Could not locate {missing.group(1)} {name!r}: it was defined in the script that saved the model "
                    f"(Keras recorded its module as {user_module}, which no import provides): put it in a module "
                    f"beside the model, e.g. {name}_def.py with the same def {name}(...) and the line "
                    f"keras.saving.get_custom_objects()[{name!r}] = {name}, and give --import {name}_def (or "
                    f"imports = [\"{name}_def\"] in autotune.toml)")
        hint = IMPORT_HINT if user_module is None else IMPORT_HINT.replace("MODULE", user_module)
        source = f" (saved from module {user_module})" if user_module else ""
        return f"Could not locate {missing.group(1)} {missing.group(2)!r}{source}: {hint}"
    first = text.splitlines()[0] if text else type(error).__name__
    cause = re.search(r"Exception encountered: (.+?)(?: Full object config:|$)", " ".join(text.split()))
    if cause and cause.group(1) not in first:
        first = f"{first} ... {cause.group(1)}"
    hint = f"; if the model has custom layers, losses or a subclassed model, {IMPORT_HINT}" \
        if re.search(r"custom|deserializ|register_keras_serializable|from_config", text) else ""
    return " ".join(first.split())[:500] + hint


def load_user_model(settings: dict, notes: list[str] | None = None):
    """Import the user's code, load and check the model (the CLI's model, with everything that makes
    it usable checked before capture); what loading it said for the report goes into ``notes``."""
    model_file: Path = settings["model_file"]
    import_user_code(settings.get("imports", []), model_file.parent)
    model = load_model(model_file, describe_error=describe_load_error, notes=notes)
    shapes = settings.get("input_shapes")
    if shapes:
        from rewriter.trace.step_inputs import CaptureError, check_input_shape_names

        try:
            check_input_shape_names(model, shapes)
        except CaptureError as error:
            where = settings.get("input_shapes_from", "input_shapes")
            raise InputError(f"{where}: {str(error).removeprefix('input_shapes: ')}") from None
    return model


def model_notes(model) -> list[str]:
    """What the user should know about how the tool treats this model (for the summary and report)."""
    notes = []
    compiled_with = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    if getattr(model, "jit_compile", False) is True or compiled_with.get("jit_compile") is True:  # Keras may drop it
        notes.append("the model is compiled with jit_compile=True, but the swapping step runs without XLA: swap "
                     "ops must stay separate ops (an XLA cluster would fuse them away), so the figures here and "
                     "model.fit with rewriter.use_swap_step are of the step without XLA; it may be slower than the "
                     "model's XLA step, and XLA's own memory use is not what was simulated")
    return notes
