"""The alert rules and the Grafana dashboard of deploy/: the rules pass `promtool check
rules`, `promtool test rules` has a test per alert that fires it, every panel's PromQL
parses (promtool reads it as a recording rule) and names only metrics the server or
neuron-monitor's exporter exports, and the dashboard has the panels an operator needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from handlers.telemetry.catalog import FAMILIES, SAMPLE_NAMES

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "inf2serve-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "inf2serve-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "inf2serve.json"
MAKE_DASHBOARD = ROOT / "deploy" / "grafana" / "make_dashboard.py"
GUIDE = ROOT / "docs" / "monitoring.md"
#: what neuron-monitor-prometheus.py exports (the fake mirrors it:
#: tests/fakes/neuron_tools/bin/neuron-monitor-prometheus.py)
NEURON_MONITOR_SERIES = {
    "neuroncore_utilization_ratio", "neuron_runtime_memory_used_bytes",
    "execution_latency_seconds", "execution_status_total", "execution_errors_total",
    "neuron_runtime_vcpu_usage_ratio", "system_vcpu_usage_ratio", "system_vcpu_count",
    "system_memory_used_bytes", "system_memory_total_bytes", "instance_info"}
#: TorchServe 0.12's own frontend metrics (ts/configs/metrics.yaml), on the same target
TORCHSERVE_SERIES = {"ts_inference_requests_total", "ts_inference_latency_microseconds",
                     "ts_queue_latency_microseconds"}
#: Grafana's variables as a query sees them once filled in
VARIABLES = {"$model_name": ".*", "$instance_id": ".*", "$__rate_interval": "1m"}

#: PromQL's aggregations and keywords (functions are told by the `(` after them)
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group", "by", "without", "on", "ignoring", "and",
                "or", "unless", "bool", "group_left", "group_right", "offset"}

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="needs Debian's prometheus (promtool): "
                                           "make install-prometheus")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


def panel_queries(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL with the variables filled in) for every panel's target."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers before `{`, or bare ones
    that are not functions, aggregations, keywords or label names."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    names = set()
    token = r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{|\[|\(|\)|$|\s)"
    for found in re.finditer(token, without_strings):
        name, after = found.groups()
        if after == "(" or name in PROMQL_WORDS:
            continue
        start = found.start()
        inside_by = re.search(r"(by|without|on|ignoring)\s*\([^)]*$", without_strings[:start])
        if not inside_by:
            names.add(name)
    return names


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    """A test expecting an alert that the rules do not fire fails: the suite above means
    something."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(RULES)]
    first = tests["tests"][0]["alert_rule_test"][-1]
    first["exp_alerts"][0]["exp_labels"]["instance"] = "elsewhere:1"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    assert promtool("test", "rules", str(tmp_path / "t.yaml")).returncode != 0


def test_every_alert_has_a_test_that_fires_it() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert alerts == {"Inf2ServeDown", "Inf2ServeWorkerDown", "Inf2ServeErrorRatioHigh",
                      "Inf2ServeTimeToFirstTokenHigh", "Inf2ServeQueueGrowing"}
    fired, quiet = set(), set()
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    assert fired == alerts and quiet == alerts  # each one fires, and each one waits first


def test_the_dashboard_is_its_scripts_output(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(MAKE_DASHBOARD), str(tmp_path / "d.json")], check=True,
                   capture_output=True)
    assert (tmp_path / "d.json").read_text() == DASHBOARD.read_text(), \
        "deploy/grafana/inf2serve.json is stale: run python deploy/grafana/make_dashboard.py"


@needs_promtool
def test_every_panel_query_parses(tmp_path: Path) -> None:
    queries = panel_queries()
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]}]}
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(tmp_path / "panels.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (le (rate(x[1m]))"}]}]}))
    assert promtool("check", "rules", str(tmp_path / "bad.yaml")).returncode != 0


def cheat_sheet() -> list[str]:
    """The PromQL lines of docs/monitoring.md's ```promql blocks."""
    blocks = re.findall(r"```promql\n(.*?)```", GUIDE.read_text(), re.S)
    return [line for b in blocks for line in b.splitlines() if line and not line.startswith("#")]


@needs_promtool
def test_the_cheat_sheet_parses(tmp_path: Path) -> None:
    queries = cheat_sheet()
    assert len(queries) >= 10
    (tmp_path / "sheet.yaml").write_text(yaml.safe_dump({"groups": [{"name": "sheet", "rules": [
        {"record": f"sheet:query_{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    done = promtool("check", "rules", str(tmp_path / "sheet.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_queries_and_alerts_name_only_exported_metrics() -> None:
    server = set().union(*SAMPLE_NAMES.values())
    exprs = [e for _, e in panel_queries()] + cheat_sheet() + [
        r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    used = set().union(*(metric_names(e) for e in exprs))
    known = server | NEURON_MONITOR_SERIES | TORCHSERVE_SERIES | {"up"}
    assert used <= known, used - known
    assert metric_names('sum by (le, x) (rate(a_bucket{m=~"b"}[1m])) / on (y) c') == {
        "a_bucket", "c"}


def test_the_dashboard_has_what_an_operator_needs() -> None:
    queries = panel_queries()
    uses = {name for _, e in queries for name in metric_names(e)}
    needed = {
        "load": {"vllm:num_requests_running", "vllm:num_requests_waiting"},
        "latency percentiles": {"vllm:time_to_first_token_seconds_bucket",
                                "vllm:inter_token_latency_seconds_bucket",
                                "vllm:e2e_request_latency_seconds_bucket"},
        "throughput": {"vllm:generation_tokens_total", "vllm:prompt_tokens_total"},
        "errors": {"vllm:request_success_total"},
        "slots": {"vllm:kv_cache_usage_perc", "inf2serve_slots"},
        "speculation acceptance": {"vllm:spec_decode_num_accepted_tokens_total",
                                   "vllm:spec_decode_num_draft_tokens_total"},
        "NeuronCore utilization": {"neuroncore_utilization_ratio"},
        "device memory": {"neuron_runtime_memory_used_bytes"},
    }
    for what, names in needed.items():
        assert names <= uses, (what, names - uses)
    assert any("histogram_quantile(0.99" in e for _, e in queries)
    # every family the server exports is on some panel, but the per-request time per token
    # (the inter-token panel shows the same per token) and the inference time (prefill plus
    # decode, both shown)
    shown = {f.name for f in FAMILIES if SAMPLE_NAMES[f.name] & uses}
    assert {f.name for f in FAMILIES} - shown == {"vllm:request_time_per_output_token_seconds",
                                                  "vllm:request_inference_time_seconds"}
