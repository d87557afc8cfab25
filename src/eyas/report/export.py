"""The report's Export section: the folders `eyas export` wrote for serving engines, and the commands that serve
them.

A section function takes (RunFiles, Loaded) and returns (HTML body, ran), as eyas.report.sections describes.
"""

from __future__ import annotations

from eyas.report.page import esc, not_run, table
from eyas.report.run_files import Doc, Loaded, RunFiles


def _serve(exports: list[tuple[str, Doc]]) -> str:
    """The commands that serve the exported folders (see eyas.draft.export), with this run's paths."""
    lines = []
    for _, m in exports:
        fmt, out = m.get("summary", "format"), m.get("summary", "out")
        if fmt == "eagle3" and (m.get("summary", "variants") or m.get("summary", "fc_norm")):
            lines += ["# vLLM, given the target model (TARGET); SGLang was not checked for EAGLE-3.1 variants",
                      f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\"}}'"]
        elif fmt == "eagle3":
            lines += ["# SGLang or vLLM, given the target model (TARGET)",
                      f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                      f"--speculative-draft-model-path {out}",
                      f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\"}}'"]
        elif fmt == "speculators":
            lines += ["# vLLM reads the target (the verifier) and the speculative settings from the folder",
                      f"vllm serve {out}"]
    return f"<h3>Serving the draft</h3><pre><code>{esc(chr(10).join(lines))}</code></pre>" if lines else ""


def sec_export(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    exports = f.stages("export")
    if not exports:
        return not_run("no export stage finished in this run"), False
    rows = [[f"<strong>{esc(m.get('summary', 'format'))}</strong>",
             f'<code class="path">{esc(f.name(f.resolve(str(m.get("summary", "out")))))}</code>',
             m.num("summary", "tensors"), m.bytes("summary", "bytes"), esc(m.get("summary", "dtype")),
             esc(m.get("summary", "vllm_layer_ids")), esc(m.get("summary", "sglang_layer_ids"))] for _, m in exports]
    return (table(["format", "folder", "tensors", "weights", "dtype", "layer ids (vLLM)", "layer ids (SGLang)"], rows,
                  numeric=(2, 3)) + _serve(exports)), True
