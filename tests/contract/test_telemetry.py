"""Every metric name and label the proxy reads, on both backends, and the proxy's own parser
applied to what each backend really exposes."""

from __future__ import annotations

import pytest

from contract.client import Backend, Engine, post_json, scrape, scrape_text

# Read by the proxy's scraper (DESIGN §3) and shown on the dashboard.
ENGINE_LABELLED = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")


async def _exercise(engine: Engine, model: str) -> None:
    # Counters and histograms appear once something was served.
    status, _ = await post_json(engine.url + "/v1/completions",
                                {"model": model, "prompt": "the cache the cache the cache",
                                 "max_tokens": 16, "temperature": 0})
    assert status == 200


@pytest.mark.parametrize("which", ["a", "b"])
async def test_metric_names_and_labels(backend: Backend, which: str) -> None:
    engine: Engine = getattr(backend, which)
    await _exercise(engine, backend.model)
    samples = await scrape(engine.metrics_url)
    names = {s.name for s in samples}
    for name in ENGINE_LABELLED:
        assert name in names, f"{name} missing"
        for s in (s for s in samples if s.name == name):
            assert s.labels.get("model_name") == backend.model, s
            assert "engine" in s.labels, s
    for hist in HISTOGRAMS:
        assert f"{hist}_bucket" in names and f"{hist}_count" in names, hist
    usage = [s.value for s in samples if s.name == "vllm:kv_cache_usage_perc"]
    assert all(0.0 <= u <= 1.0 for u in usage)
    per_pos = sorted(s.labels["position"] for s in samples
                     if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == [str(i) for i in range(backend.num_speculative_tokens)]


async def test_cache_config_info_labels(backend: Backend) -> None:
    samples = await scrape(backend.a.metrics_url)
    info = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert len(info) == 1
    labels = info[0].labels
    assert labels["block_size"] == str(backend.block_size)
    assert int(labels["num_gpu_blocks"]) > 0
    assert labels["enable_prefix_caching"] == "True"


async def test_proxy_parser_reads_backend_metrics(backend: Backend) -> None:
    telemetry = pytest.importorskip("proxy.core.telemetry")
    for engine in (backend.a, backend.b):
        text = await scrape_text(engine.metrics_url)
        snap = telemetry.parse_metrics(text, taken_at=1.0)
        assert snap.block_size == backend.block_size
        assert snap.num_gpu_blocks and snap.num_gpu_blocks > 0
        assert 0.0 <= snap.kv_usage <= 1.0
        assert snap.running >= 0 and snap.waiting >= 0
        assert snap.draining is False
        assert snap.spec_drafts >= 0 and snap.prefix_queries >= 0
