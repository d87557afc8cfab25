"""The options several stages share, declared once: each stage's field is made here, with one help text and one
check, so `--dtype`, `--device`, `--target`, `--trust-remote-code` and `--overwrite` read the same in every
command (and in every TOML table).

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ExtractConfig(StageConfig):
        target: str = target_opt()
        dtype: Dtype = dtype_opt("the target's forward pass")
        device: str = device_opt()

`StageConfig.__post_init__` runs each shared option's check (`check_dtype`, `check_device`) before the stage's own
`validate`, so a value from the CLI, a TOML table or code is refused the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from eyas.core.config import opt
from eyas.core.target import DEFAULT_TARGET

# The one dtype vocabulary. auto: bfloat16 where the device multiplies it in hardware (CUDA from Ampere on, CPUs
# with AVX512-BF16 or AMX), float32 elsewhere (eyas.core.precision.choose_dtype). Every spelling is accepted on
# the command line and in TOML (bfloat16, float32, torch.float16, ...) and read as one of these.
Dtype = Literal["auto", "bf16", "fp32", "fp16"]
DTYPES: tuple[str, ...] = ("auto", "bf16", "fp32", "fp16")
DEVICE_HELP = "auto (cuda:LOCAL_RANK when CUDA is present, else cpu), cpu, cuda (cuda:LOCAL_RANK) or cuda:N"


def target_opt(default: str = DEFAULT_TARGET, role: str = "") -> Any:
    """--target: a built-in name, a local Hugging Face folder, a .gguf file or a Hub id (`org/name@revision`)."""
    what = "the target model: a built-in name, a Hugging Face folder, a .gguf file or a Hub id (org/name@rev)"
    return opt(default, f"{what}; {role}" if role else what)


def trust_remote_code_opt() -> Any:
    return opt(False, "let transformers run the code shipped with a target's folder or Hub repository (needed by "
                      "some configs, e.g. Kimi-K2's); off by default, and said on the console when on")


def trusted_code_line(target: str) -> str:
    """What a stage says on its console when --trust-remote-code is on, before it loads `target`."""
    return f"--trust-remote-code: transformers may run the Python code shipped with {target}"


def dtype_opt(what: str, auto: str = "") -> Any:
    """--dtype of `what` (e.g. "the target's forward pass"); `auto` says what auto means when it is not the
    device's fast type."""
    meaning = auto or "bf16 where the device multiplies it in hardware, else fp32"
    return opt("auto", f"dtype of {what}: auto ({meaning}), bf16, fp32 or fp16 (any spelling: bfloat16, "
                       "float32, ...)", choices=DTYPES, check=check_dtype)


def device_opt() -> Any:
    return opt("auto", DEVICE_HELP, check=check_device)


def collective_timeout_opt() -> Any:
    """--collective-timeout: how long a rank waits in a collective for the others (torch.distributed's timeout)."""
    return opt(600.0, "seconds a rank waits for the others in a collective before it stops (a hung or lost rank); "
                      "raise it where one rank's work between collectives can take longer", check=_positive)


def _positive(value: float) -> str | None:
    return None if value > 0 else f"--collective-timeout {value}: a number of seconds above 0"


def overwrite_opt(what: str) -> Any:
    """--overwrite of an output `what` wrote (only its own files are removed)."""
    return opt(False, f"start the output anew: remove what {what} wrote there (nothing else)")


def check_device(value: str) -> str | None:
    """Why `value` is not a device eyas takes (None when it is): the check the CLI and TOML share."""
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return f"--device {value!r} is not one of {DEVICE_HELP}"


def check_dtype(value: str) -> str | None:
    from_any = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    if value in DTYPES or value in from_any:
        return None
    return f"--dtype {value!r} is not one of {', '.join(DTYPES)}"

