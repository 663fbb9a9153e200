"""``structllm run --speculative-config``: a real server (null model, real processes and
rings) drafts and verifies, answers exactly as a server without it, and reports vLLM's
spec-decode metrics; a bad config stops the CLI with an error naming it."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import HANG_S, ROOT
from tests.support.server import Server, completion, sse_text

NULL = ("--null-model", "--max-model-len", "2048")
# the null model's output repeats nothing of its prompt, but the suffix method drafts a
# prompt's second and third answers from the first one's output
SPEC = '{"method": "suffix", "num_speculative_tokens": 3}'
PROMPTS = ["one two three one two three one two", "a b a b a b a b a b", "x y z"]


def answers(s: Server) -> list[object]:
    out = []
    for p in PROMPTS:
        for body in (
            completion(p, 24, logprobs=2),
            completion(p, 24, stream=True),
            {**completion(p, 24), "stop": [" 5"], "ignore_eos": False},
        ):
            status, data = s.post("/v1/completions", body)
            assert status == 200, data
            if isinstance(data, dict):
                c = data["choices"][0]
                out.append((c["text"], c["finish_reason"], c.get("logprobs")))
            else:
                out.append(sse_text(data))
    return out


def test_speculative_server_equals_plain_and_reports_metrics() -> None:
    with Server(*NULL) as plain:
        want = answers(plain)
    with Server(*NULL, "--speculative-config", SPEC) as s:
        got = answers(s)
        assert s.metric("spec_decode_num_accepted_tokens_total") > 0
        assert s.metric("spec_decode_num_draft_tokens_total") >= s.metric(
            "spec_decode_num_drafts_total"
        )
        s.wait_idle()
    assert got == want


def test_bad_speculative_config_is_refused_by_name() -> None:
    for bad, words in [
        ('{"method": "eagle"}', "method must be one of ngram, suffix"),
        ("{oops", "not valid JSON"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "structllm", "run", *NULL, "--speculative-config", bad],
            cwd=ROOT,
            capture_output=True,
            timeout=HANG_S,
        )
        assert proc.returncode == 2
        assert words in proc.stderr.decode()
        assert "--speculative-config" in proc.stderr.decode()
