// The dashboard: polls GET stats (JSON, docs/server.md) each second and draws it. Every figure
// element keeps the raw number in data-value, the text is that number formatted.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;

  const percent = (x) => (x * 100).toFixed(1) + "%";
  const seconds = (x) => (x < 1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s");
  const rate = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));
  const count = (x) => String(Math.round(x));
  function si(x, unit) {
    const prefixes = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [size, prefix] of prefixes) if (Math.abs(x) >= size) return (x / size).toPrecision(3) + " " + prefix + unit;
    return x.toPrecision(3) + " " + unit;
  }

  // Show `value` in element `id` (— when unknown); data-value keeps the raw number for scripts and tests.
  function figure(id, value, format) {
    const element = $(id);
    const known = value !== null && value !== undefined;
    element.dataset.value = known ? String(value) : "";
    element.textContent = known ? format(value) : "—";
  }

  const colors = { roof: "#555", prefill: "#d9480f", decode: "#1c7ed6", current: "#2b8a3e", generation: "#1c7ed6", prompt: "#d9480f" };
  const dots = (color, size) => ({ stroke: color, fill: color, width: 0, paths: () => null, points: { show: true, size, fill: color, stroke: color } });
  const width = (id) => Math.max(320, $(id).clientWidth || 560);

  const roofline = new uPlot({
    width: width("roofline"), height: 340,
    scales: { x: { time: false, distr: 3, log: 10 }, y: { distr: 3, log: 10 } },
    axes: [
      { label: "arithmetic intensity (FLOP/byte)", values: (u, ticks) => ticks.map((t) => (t == null ? "" : si(t, ""))) },
      { label: "FLOP/s", size: 70, values: (u, ticks) => ticks.map((t) => (t == null ? "" : si(t, ""))) },
    ],
    legend: { live: false },
    series: [
      {},
      { label: "roofline", stroke: colors.roof, width: 2, spanGaps: true, points: { show: false } },
      { label: "prefill steps", ...dots(colors.prefill, 6) },
      { label: "decode steps", ...dots(colors.decode, 6) },
      { label: "decode at current batch", ...dots(colors.current, 11), points: { show: true, size: 11, fill: colors.current, stroke: colors.current, width: 2 } },
    ],
  }, [[1, 10], [null, null], [null, null], [null, null], [null, null]], $("roofline"));

  const rates = new uPlot({
    width: width("rates"), height: 220,
    scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
    axes: [{ label: "seconds ago" }, { label: "tokens/s", size: 60 }],
    legend: { live: false },
    series: [
      {},
      { label: "generated", stroke: colors.generation, width: 2 },
      { label: "prompt", stroke: colors.prompt, width: 2 },
    ],
  }, [[-60, 0], [null, null], [null, null]], $("rates"));

  // The roofline's series share one x array: every point's x in order, each series null elsewhere.
  function rooflineData(r) {
    const attainable = (x) => Math.min(r.peak_flops, r.memory_bandwidth * x);
    const rows = [];
    const steps = r.steps.filter((s) => s.intensity > 0 && s.flops_per_second > 0);
    let low = Math.min(0.1, ...steps.map((s) => s.intensity / 2), r.decode_intensity / 2);
    let high = Math.max(r.ridge_intensity * 20, ...steps.map((s) => s.intensity * 2));
    for (let x = low; x < high; x *= 1.5) rows.push([x, attainable(x), null, null, null]);
    rows.push([r.ridge_intensity, r.peak_flops, null, null, null], [high, attainable(high), null, null, null]);
    for (const s of steps) rows.push(s.kind === "prefill" ? [s.intensity, null, s.flops_per_second, null, null]
                                                        : [s.intensity, null, null, s.flops_per_second, null]);
    rows.push([r.decode_intensity, null, null, null, attainable(r.decode_intensity)]);
    rows.sort((a, b) => a[0] - b[0]);
    return [0, 1, 2, 3, 4].map((i) => rows.map((row) => row[i]));
  }

  function show(s) {
    $("model-name").textContent = s.model;
    figure("running", s.requests.running, count);
    figure("waiting", s.requests.waiting, count);
    figure("kv-usage", s.kv_cache.usage, percent);
    $("kv-detail").textContent = `${s.kv_cache.blocks - s.kv_cache.free_blocks} of ${s.kv_cache.blocks} blocks held, ` +
      `${s.kv_cache.cached_blocks} cached (${s.kv_cache.tokens} tokens in all)`;
    figure("state-usage", s.state_slots && s.state_slots.usage, (x) => `${percent(x)} of ${s.state_slots.slots}`);
    if (!s.state_slots) $("state-usage").textContent = "none (no recurrent layers)";
    figure("hit-rate", s.prefix_cache.queried_tokens ? s.prefix_cache.hit_rate : null, percent);
    figure("hit-rate-minute", s.prefix_cache.hit_rate_last_minute, percent);
    figure("prompt-rate", s.throughput.prompt_tokens_per_second, rate);
    figure("generation-rate", s.throughput.generation_tokens_per_second, rate);
    figure("prompt-total", s.totals.prompt_tokens, count);
    figure("generation-total", s.totals.generation_tokens, count);
    const ttft = s.latency.ttft_seconds, itl = s.latency.inter_token_seconds;
    figure("ttft-count", ttft.count, count);
    for (const q of ["p50", "p90", "p99"]) {
      figure("ttft-" + q, ttft[q], seconds);
      figure("itl-" + q, itl[q], seconds);
    }
    const r = s.roofline;
    figure("mfu", r.prefill_mfu, percent);
    figure("mbu", r.decode_mbu, percent);
    // Above 100% the peak divided by is wrong (a quick estimate on a busy machine): say so.
    for (const [id, exceeded] of [["mfu", r.prefill_peak_exceeded], ["mbu", r.decode_peak_exceeded]]) {
      $(id).textContent = exceeded ? "unknown" : $(id).textContent;
      $(id).title = exceeded ? "the measured rate is above the peak: the peak is too low (see the roofline)" : "";
    }
    figure("mfu-minute", r.prefill_mfu_last_minute, percent);
    figure("mbu-minute", r.decode_mbu_last_minute, percent);
    $("hardware").textContent = `${r.hardware} [${r.hardware_origin}${r.hardware_origin === "estimate" ? ": run tuili probe for measured figures" : ""}]: ` +
      `peak ${si(r.peak_flops, "FLOP/s")} ${r.compute_dtype}, memory ${si(r.memory_bandwidth, "B/s")}, ridge at ${r.ridge_intensity.toFixed(1)} FLOP/byte` +
      (r.prefill_peak_exceeded || r.decode_peak_exceeded ? ". Steps run above this roof: its figures are too low (run tuili probe, or pass --hardware)." : "");
    $("intensity").textContent = `${r.decode_batch} sequence${r.decode_batch === 1 ? "" : "s"} at ${r.decode_context_len} tokens: ` +
      `${r.decode_intensity.toFixed(2)} FLOP/byte`;
    $("intensity").dataset.value = String(r.decode_intensity);
    roofline.setData(rooflineData(r));
    const h = s.throughput.history;
    if (h.age_seconds.length) rates.setData([h.age_seconds, h.generation_tokens_per_second, h.prompt_tokens_per_second]);
  }

  async function poll() {
    try {
      const response = await tuili.call("stats", { cache: "no-store" });
      if (!response.ok) throw new Error(await tuili.errorText(response));
      show(await response.json());
      $("status").textContent = "live";
      $("status").className = "status live";
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    } catch (error) {
      $("status").textContent = "no data: " + error.message;
      $("status").className = "status stale";
    }
    setTimeout(poll, POLL_MS);
  }

  window.addEventListener("resize", () => {
    roofline.setSize({ width: width("roofline"), height: 340 });
    rates.setSize({ width: width("rates"), height: 220 });
  });
  poll();
})();
