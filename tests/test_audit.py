"""`sglang-dspark audit` against fake SGLang servers: the decisions, without model work.

The fakes answer /generate and /server_info in SGLang's JSON shapes (checked against real
servers by tests/test_losslessness.py). What is asserted: a server that does not speculate, or
whose drafts are never accepted, fails with the reason (and costs no sampling); the greedy
near-tie rule excuses a divergence only within the reference's own measured rounding; a
sampling comparison with nothing random in it fails.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from sglang_dspark.verification.audit import audit

PROMPT = [1, 2, 3]
GREEDY = [10, 11, 12, 13, 14, 15]


class FakeServer:
    """`generate(body) -> json` behind a real HTTP socket on 127.0.0.1."""

    def __init__(self, generate: Callable[[dict], object], info: dict | None = None):
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(info or {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                self._send(generate(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def sampled(self) -> int:
        return sum(b["sampling_params"].get("temperature") == 1.0 for b in self.bodies)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(generate, info=None):
        made.append(FakeServer(generate, info))
        return made[-1]

    yield make
    for f in made:
        f.close()


SPEC_META = {"spec_verify_ct": 3, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 21}
SPEC_INFO = {"internal_states": [{"avg_spec_accept_length": 1.7}]}


def _sampler(probs, seed, meta=None):
    """Temperature-1 batches: 4 tokens, each i.i.d. from `probs`."""
    rng = np.random.default_rng(seed)

    def rows(body):
        n = len(body["input_ids"])
        out = rng.choice(len(probs), size=(n, 4), p=probs).tolist()
        return [{"output_ids": o, "meta_info": dict(meta or {})} for o in out]

    return rows


def _server(greedy, probs, seed, meta=SPEC_META):
    sample = _sampler(probs, seed, meta)

    def generate(body):
        if body["sampling_params"]["temperature"] == 0:
            return {"output_ids": greedy, "meta_info": dict(meta or {})}
        return sample(body)

    return generate


def _reference(probs, seed, *, greedy=GREEDY, top=None, decoded=None, prefill=None):
    """Greedy answers with top-5 log-probs; prefill answers (logprob_start_len set) with the
    input log-probs of the continuation and the ids asked for at each position."""
    sample = _sampler(probs, seed)
    top = top or [[[-0.1, t, None], [-3.0, 99, None]] for t in greedy]
    decoded = decoded or [[e[0][0], t, None] for e, t in zip(top, greedy)]

    def generate(body):
        if "logprob_start_len" in body:
            n = len(body["input_ids"]) - len(PROMPT)
            chosen = [[None, PROMPT[-1], None]] + [prefill["chosen"][k] for k in range(n)]
            ids = [None] + [prefill["ids"][k] for k in range(n)]
            meta = {"input_token_logprobs": chosen, "input_token_ids_logprobs": ids}
            return {"output_ids": [0], "meta_info": meta}
        if body["sampling_params"]["temperature"] == 0:
            meta = {"output_top_logprobs": top, "output_token_logprobs": decoded}
            return {"output_ids": greedy, "meta_info": meta}
        return sample(body)

    return generate


PROBS = [0.5, 0.3, 0.2]


def test_a_server_that_does_not_speculate_fails_before_any_sampling(fakes):
    ref = fakes(_reference(PROBS, 0))
    plain = fakes(_server(GREEDY, PROBS, 1, meta=None))
    report = audit(plain.url, ref.url, [PROMPT], greedy_tokens=6, samples=50)
    assert report.greedy_passed  # the outputs are equal: only the counts can tell
    assert not report.passed
    assert "no draft was proposed" in report.speculation_problem
    assert plain.sampled() == 0 and ref.sampled() == 0
    assert "NOT LOSSLESS" in report.render()


def test_drafts_proposed_but_never_accepted_fail(fakes):
    ref = fakes(_reference(PROBS, 0))
    meta = dict(SPEC_META, spec_num_correct_drafts=0)
    server = fakes(_server(GREEDY, PROBS, 1, meta=meta), SPEC_INFO)
    report = audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=200)
    assert report.sampling_passed
    assert not report.passed and "none accepted" in report.speculation_problem


def test_a_lossless_speculative_server_passes_with_counts_and_power(fakes):
    ref = fakes(_reference(PROBS, 0))
    server = fakes(_server(GREEDY, PROBS, 1), SPEC_INFO)
    report = audit(server.url, ref.url, [PROMPT, PROMPT], greedy_tokens=6, samples=300)
    assert report.passed, report.render()
    assert report.drafts_accepted > 0 and report.server_accept_length == 1.7
    text = report.render()
    assert "avg_spec_accept_length 1.7" in text and "joint TV >= " in text
    assert 0 < report.detectable_tv_position < report.detectable_tv_joint < 1


def test_a_sampling_comparison_with_nothing_random_fails(fakes):
    ref = fakes(_reference([1.0], 0))
    server = fakes(_server(GREEDY, [1.0], 1), SPEC_INFO)
    report = audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=100)
    assert not report.passed
    assert "no test could run" in report.sampling_summary


@pytest.mark.parametrize(
    ("margin", "tau", "prefill_margin", "tie"),
    [
        (0.10, 0.06, 0.10, True),  # within twice the measured rounding (bf16-like)
        (0.30, 0.06, 0.30, False),  # beyond it: a real divergence
        (0.30, 0.01, -0.05, True),  # the reference's own multi-token forward picks x_j
        (1e-3, 1e-6, 1e-3, False),  # float32-like rounding excuses nothing but ties
        (0.0, 0.0, 0.0, True),  # an exact tie
    ],
)
def test_greedy_divergence_is_a_near_tie_only_within_the_reference_rounding(
    fakes, margin, tau, prefill_margin, tie
):
    j, x_j = 3, 77  # the server takes token 77 at position 3, the reference GREEDY[3]
    server_greedy = GREEDY[:j] + [x_j, 1, 2]
    y_j = GREEDY[j]
    top = [[[-0.1, t, None], [-3.0, 99, None]] for t in GREEDY]
    top[j] = [[-1.0, y_j, None], [-1.0 - margin, x_j, None]]
    decoded = [[e[0][0], t, None] for e, t in zip(top, GREEDY)]
    # prefill log-probs of y_0..y_j: the decode ones moved by at most tau (at position 1)
    chosen = [[v, t, None] for (v, t, _) in decoded]
    chosen[1] = [decoded[1][0] + tau, GREEDY[1], None]
    ids = [[[-1.0, x_j, None], [-1.0, y_j, None]] for _ in GREEDY]
    ids[j] = [[-1.0 - prefill_margin, x_j, None], [-1.0, y_j, None]]
    ref = fakes(_reference(PROBS, 0, top=top, decoded=decoded,
                           prefill={"chosen": chosen, "ids": ids}))  # fmt: skip
    server = fakes(_server(server_greedy, PROBS, 1), SPEC_INFO)
    report = audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=200)
    g = report.greedy[0]
    assert (g.first_divergence, g.near_tie) == (j, tie), g
    assert g.rounding == pytest.approx(tau)
    assert report.greedy_passed is tie
    assert ("rounding near-tie" in g.describe()) is tie


def test_a_server_token_outside_the_reference_top_k_is_never_a_near_tie(fakes):
    server = fakes(_server(GREEDY[:2] + [55, 1, 2, 3], PROBS, 1), SPEC_INFO)
    ref = fakes(_reference(PROBS, 0))
    report = audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=200)
    assert not report.greedy_passed
    assert "not in the reference's top-5" in report.greedy[0].describe()


REF_INFO = {"model_path": "/models/target", "dtype": "bfloat16"}


def test_reference_samples_are_kept_reused_and_topped_up(fakes, tmp_path):
    """--reference-samples: the first audit draws and writes them, a second with fewer samples
    draws nothing from the reference, one with more draws only the missing ones."""
    ref = fakes(_reference(PROBS, 0), REF_INFO)
    server = fakes(_server(GREEDY, PROBS, 1), SPEC_INFO)
    store = tmp_path / "ref.json"
    first = audit(server.url, ref.url, [PROMPT, PROMPT], greedy_tokens=6, samples=200,
                  reference_samples=store)  # fmt: skip
    assert first.passed, first.render()
    assert first.sampling_tests > 0 and first.sampling_joint_tests == 2
    assert ref.sampled() == 2
    kept = json.loads(store.read_text())
    assert kept["key"]["model_path"] == "/models/target" and kept["key"]["dtype"] == "bfloat16"
    assert [len(s) for s in kept["samples"]] == [200, 200]

    again = audit(server.url, ref.url, [PROMPT, PROMPT], greedy_tokens=6, samples=120,
                  reference_samples=store)  # fmt: skip
    assert again.passed and ref.sampled() == 2  # no new reference batch
    more = audit(server.url, ref.url, [PROMPT, PROMPT], greedy_tokens=6, samples=260,
                 reference_samples=store)  # fmt: skip
    assert more.passed and ref.sampled() == 4
    assert [len(b["input_ids"]) for b in ref.bodies[-2:]] == [60, 60]  # only the missing ones
    assert [len(s) for s in json.loads(store.read_text())["samples"]] == [260, 260]


def test_reference_samples_drawn_otherwise_are_refused_before_any_request(fakes, tmp_path):
    from sglang_dspark.verification.audit import ReferenceSamplesError

    ref = fakes(_reference(PROBS, 0), REF_INFO)
    server = fakes(_server(GREEDY, PROBS, 1), SPEC_INFO)
    store = tmp_path / "ref.json"
    audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=50, reference_samples=store)
    posts = len(server.bodies)
    with pytest.raises(ReferenceSamplesError, match="differing: prompt_ids"):
        audit(server.url, ref.url, [PROMPT + [4]], greedy_tokens=6, samples=50,
              reference_samples=store)  # fmt: skip
    with pytest.raises(ReferenceSamplesError, match="differing: sampling_params"):
        audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=50, sample_tokens=3,
              joint_tokens=2, reference_samples=store)  # fmt: skip
    assert len(server.bodies) == posts  # refused before the greedy part
    store.write_text("{not json")
    with pytest.raises(ReferenceSamplesError, match="not a reference-samples file"):
        audit(server.url, ref.url, [PROMPT], greedy_tokens=6, samples=50,
              reference_samples=store)  # fmt: skip
