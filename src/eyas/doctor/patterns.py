"""The line patterns of the training-log formats `eyas doctor` reads (eyas.doctor.logformats shows each format's
lines and reads them with these): step records, eyas's console lines, the phrases that state a figure, progress
bars, end and crash markers.

Every pattern is linear in the line length: each repeat is bounded and none is nested inside another.
"""

from __future__ import annotations

import re

_NUM = r"[-+]?(?:\d{1,20}(?:\.\d{0,20})?|\.\d{1,20})(?:[eE][-+]?\d{1,3})?"
_INT = r"\d[\d,]{0,18}"

RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d{1,5})\]:\s?")
RANK_ANYWHERE = re.compile(r"\[(?:rank|default)\d{1,5}\]:")
ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]")

SF_STEP = re.compile(r"step (\d{1,12}): \{")
SF_KV = re.compile(r"'([\w/.\-]{1,80})': (" + _NUM + r"|nan|inf|-inf)")
RICH_HEAD = re.compile(r"^(?:\[\d\d:\d\d:\d\d\]|\s{11})\s?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s{1,9}(\S.*)$")
RICH_CONT = re.compile(r"^ {20}(\S.*)$")
RICH_SOURCE = re.compile(r"\s{2,80}[\w.\-]{1,80}\.py:\d{1,6}\s{0,80}$")
HF_RECORD = re.compile(r"^\{'(loss|eval_[\w/.\-]{1,60}|train_runtime)': ")  # HF Trainer: dicts, str values in v5
HF_KV = re.compile(r"'([\w/.\-]{1,80})': '?(" + _NUM + r"|nan|inf|-inf)'?")
# DeepSpeed (log_dist, rank 0): `[Rank 0] step=12, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]`
DS_STEP = re.compile(r"\[Rank (\d{1,6})\] step=(\d{1,12}), skipped=(\d{1,12}), lr=\[(" + _NUM + ")")
# Megatron-LM / NeMo (training_log, the last rank): ` [2024-05-01 12:00:00] iteration      100/    1000 | consumed
# samples:        12800 | elapsed time per iteration (ms): 123.4 | learning rate: 1.000000E-04 | global batch size:
#   128 | lm loss: 2.345678E+00 | ...`
MEGATRON_STEP = re.compile(r"\biteration\s{1,12}(\d{1,12})/\s{0,12}(\d{1,12}) \|")
MEGATRON_KV = re.compile(r" ([a-zA-Z][\w ()/-]{0,60}?): {0,16}(" + _NUM + r"|nan|inf)(?:/" + _NUM + r")? \|")
# a settings dump, one per line: DeepSpeed's `  world_size ................... 2`, Megatron's arguments block
DOTTED = re.compile(r"(?:^|\] )\s{0,8}([a-z][a-z_]{1,60})(?: \.{1,80} | {2,8})(\d[\d,]{0,18})\s{0,80}$")
KV_EQ = re.compile(r"([\w/.\-]{1,80})=([^\s,]{1,80})")

GEN_STEP = re.compile(r"(?<![\w/])(?:global[_ ]step|step|iter(?:ation)?)['\"]?\s{0,3}[:=#]?\s{0,3}(\d{1,12})"
                      r"(?:\s{0,3}/\s{0,3}(\d{1,12}))?", re.I)
GEN_EPOCH = re.compile(r"(?<![\w/])epoch['\"]?\s{0,3}[:=]?\s{0,3}(\d{1,9}(?:\.\d{1,12})?)(?:\s{0,3}/\s{0,3}(\d{1,9}))?",
                       re.I)
GEN_LR = re.compile(r"(?<![\w/])(?:lr|learning[_ ]rate)['\"]?\s{0,3}[:=]?\s{0,3}(" + _NUM + ")", re.I)
GEN_LOSS = re.compile(r"(?<![\w/])(?:train[_/ ])?loss['\"]?\s{0,3}[:=]?\s{0,3}(" + _NUM + ")", re.I)

EYAS_DATA = re.compile(r"data: (" + _INT + r") samples over (\d{1,6}) ranks? -> (" + _INT + r")(?:-(" + _INT +
                       r"))? per rank per epoch \((" + _INT + r") (padded|dropped)\)(?: in (" + _INT +
                       r") packed sequences \(global\))?, disjoint: (yes|no)", re.I)
EYAS_PLAN = [
    ("samples", re.compile(r"plan: dataset (" + _INT + r") samples \(global\), (\d{1,6}) epochs")),
    ("batching", re.compile(r"plan: (\d{1,6}) ranks x micro-batch (\d{1,9}) \(per rank\) x grad accum (\d{1,9})")),
    ("micro", re.compile(r"plan: micro-batches per rank: (" + _INT + r") per epoch, (" + _INT + r") in all")),
    ("steps", re.compile(r"plan: optimizer steps \(global[^)]{0,60}\): (" + _INT + r") per epoch, (" + _INT +
                         r") in all")),
    ("run", re.compile(r"plan: this run takes (" + _INT + r") optimizer steps")),  # --max-steps or packing
]
EYAS_EPOCH_END = re.compile(r"epoch (\d{1,6}): (" + _INT + r") samples processed \(global\) of (" + _INT + r")")

# (fact name, pattern): the first group is the value. Phrases logs use for the figures doctor needs.
STATED = [
    ("samples", re.compile(r"(?:num[_ ]?(?:train[_ ]?)?(?:samples|examples)|dataset[_ ]size|"
                           r"train(?:ing)?[_ ](?:samples|files|examples|conversations|dataset[_ ]size)|"
                           r"len\((?:train_?)?dataset\))\s{0,3}[:=]\s{0,3}(" + _INT + ")", re.I)),
    ("samples", re.compile(r"(?:loaded|found|using)\s{1,3}(" + _INT + r")\s{1,3}(?:train(?:ing)?\s{1,3})?"
                           r"(?:samples|examples|conversations)\b", re.I)),
    ("world_size", re.compile(r"(?<![tpem]p_)world[_ ]size\s{0,3}[:=]?\s{0,3}(\d{1,6})\b", re.I)),
    ("world_size", re.compile(r"(?:nproc[_-]per[_-]node|num[_ ]processes|num[_ ]gpus)\s{0,3}[:= ]\s{0,3}(\d{1,6})\b",
                              re.I)),
    # Lightning: "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2", "Starting with 2 processes"
    ("world_size", re.compile(r"GLOBAL_RANK: \d{1,6}, MEMBER: \d{1,6}/(\d{1,6})|Starting with (\d{1,6}) processes")),
    ("batches_per_epoch", re.compile(r"(?:batches|steps|iterations|iters)\s{0,3}(?:/|per)\s{0,3}epoch\s{0,3}[:=]?"
                                     r"\s{0,3}(" + _INT + ")", re.I)),
    ("batches_per_epoch", re.compile(r"len\((?:train_?)?(?:data_?)?loader\)\s{0,3}[:=]?\s{0,3}(" + _INT + ")", re.I)),
    ("total_steps", re.compile(r"total\s{1,3}(?:training\s{1,3}|optimi[sz](?:ation|er)\s{1,3})?steps\s{0,3}[:=]?"
                               r"\s{0,3}(" + _INT + ")", re.I)),
    ("total_steps", re.compile(r"(?:max_steps|num_training_steps|total_steps)\s{0,3}[:=]\s{0,3}(" + _INT + ")", re.I)),
    ("epochs", re.compile(r"(?:num[_ ]?(?:train[_ ])?epochs|n_epochs|epochs)\s{0,3}[:=]\s{0,3}(\d{1,6})\b", re.I)),
    ("epochs", re.compile(r"\bepoch\s{1,3}\d{1,6}\s{0,2}/\s{0,2}(\d{1,6})\b", re.I)),
    ("micro_batch", re.compile(r"(?:micro[_ -]batch(?:[_ ]size)?|per[_ ]device[_ ]train[_ ]batch[_ ]size|"
                               r"(?<![\w/])batch[_ ]size(?:[_ ]per[_ ](?:device|gpu))?)\s{0,3}[:=]\s{0,3}(\d{1,6})\b",
                               re.I)),
    # HF Trainer: "Total train batch size (w. parallel, distributed & accumulation) = 4"
    ("global_batch", re.compile(r"(?:total[_ ]train[_ ]batch[_ ]size|global[_ ]batch[_ ]size)(?: \([^)]{0,60}\))?"
                                r"\s{0,3}[:=]\s{0,3}(" + _INT + ")", re.I)),
    ("grad_accum", re.compile(r"grad(?:ient)?[_ ]accum(?:ulation)?(?:[_ ]steps)?\s{0,3}[:=]\s{0,3}(\d{1,6})\b", re.I)),
]
BAR = re.compile(r"(\d{1,3})%\s?\|?[^\d\r]{0,400}?\|?\s{0,3}(\d{1,12})/(\d{1,12})\s{0,3}\[")
# Lightning's rich bar: `Epoch 1/1  ━━━━━━━━ 26/26 0:00:01 • 0:00:00 27.78it/s` (epoch index / last index)
RICH_EPOCH_BAR = re.compile(r"^Epoch (\d{1,6})/(\d{1,6})\s{1,8}[━╸╺╾╼ ]{1,400}?\s(\d{1,12})/(\d{1,12})\s{1,4}"
                            r"(?:(\d{1,5}):)?(\d{1,2}):(\d\d)\s")
RICH_EPOCH_DESC = re.compile(r"^Epoch (\d{1,6})/\d{1,6}$")  # the description eyas gives that bar's facts
TORCHTUNE_DESC = re.compile(r"^(\d{1,6})\|(\d{1,12})\|Loss: ")  # torchtune's bar: `epoch|global step|Loss: x`
BAR_ELAPSED = re.compile(r"\s?(?:(\d{1,5}):)?(\d{1,2}):(\d\d)\s?<")  # tqdm `[01:02<...`, rich `[ 0:00:06 < ...`
EPOCH_DONE = re.compile(r"training epoch (\d{1,6})/(\d{1,6}) (?:completed|complete|finished|done)", re.I)
RUN_END = re.compile(r"(?:training|train)\b.{0,40}?\b(?:completed|complete|finished|done)\b|finished training"
                     r"|Process \d{1,9} exits successfully"  # the deepspeed launcher
                     r"|Trainer\.fit` stopped: `max_(?:epochs|steps)=", re.I)  # Lightning
TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
TB_FRAME = re.compile(r'^\s{1,8}File "([^"]{1,300})", line (\d{1,7})(?:, in (\S{1,100}))?')
TB_ERROR = re.compile(r"^([A-Za-z_][\w.]{0,120}(?:Error|Exception|Exit|Interrupt|Fault))(?:: (.{0,300}))?$")
WATCHDOG = re.compile(r"Watchdog caught collective operation timeout|NCCL (?:communicator|operation).{0,40}timed? ?out"
                      r"|DistBackendError|ProcessGroupNCCL.{0,80}(?:timeout|Terminating the process)", re.I)
NCCL_RANK = re.compile(r"\[Rank (\d{1,5})\]")
ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\)")
ROOT_RANK = re.compile(r"^\s{0,4}rank\s{0,8}: (\d{1,5}) \(local_rank")
CRASH = re.compile(r"Traceback \(most recent call last\)|out of memory|OutOfMemoryError|ChildFailedError|"
                   r"Watchdog caught collective operation timeout", re.I)
VALIDATION = re.compile(r"\b(?:validation|validating|evaluating|evaluation)\b", re.I)
TORCHRUN = re.compile(r"Setting OMP_NUM_THREADS environment variable for each process")
PY_WARNING = re.compile(r"^\S{0,300}\.py:\d{1,6}: [A-Z]\w{0,40}Warning: ")
DUPLICATE_DATA = re.compile(r"allow[-_]duplicate[-_]data|\[DUPLICATE DATA\]")
