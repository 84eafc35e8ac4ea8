// omni-sidecar operator console. Polls the admin listener's JSON once a second.
// Every string from a client or the engine is set with textContent, never as HTML.
"use strict";

(function () {
  const POLL_MS = 1000;
  const HISTORY_SECONDS = 600;
  const COLORS = ["#4fa3e0", "#e0a84f", "#e0604f"];

  const state = {
    history: [],          // {t, sessions, pending, drops}
    previous: null,       // last summary (for rates)
    page: { sessions: [], budget: { pending_bytes: 1, pending_events: 1 }, live: 0, total: 0 },
    budget: { pending_bytes: 1, pending_events: 1 },
    sortKey: "age_seconds",
    sortDesc: true,
    detailId: null,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }

  function duration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
  }

  function rate(n) { return n.toFixed(n < 10 ? 1 : 0) + "/s"; }

  function clock(unix) {
    if (!unix) return "–";
    return new Date(unix * 1000).toISOString().replace("T", " ").replace("Z", "");
  }

  function setBar(fill, value, limit) {
    const ratio = limit > 0 ? Math.min(1, value / limit) : 0;
    fill.style.width = (ratio * 100).toFixed(1) + "%";
    fill.classList.toggle("warn", ratio >= 0.5 && ratio < 0.85);
    fill.classList.toggle("bad", ratio >= 0.85);
  }

  function barCell(value, limit, text) {
    const td = el("td");
    const wrap = el("div", null, "cell-bar");
    const bar = el("div", null, "bar");
    const fill = el("div", null, "fill");
    bar.appendChild(fill);
    setBar(fill, value, limit);
    wrap.appendChild(bar);
    wrap.appendChild(el("span", text, "num"));
    td.appendChild(wrap);
    return td;
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(path + ": HTTP " + response.status);
    return response.json();
  }

  function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

  // -- summary ---------------------------------------------------------------------------

  // docs/design.md, Engine capabilities: "vLLM-Omni 0.32 (preflight): bounded output, ...".
  function engineBehaviour(c) {
    if (!c) return "–";
    const flags = ["bounded_output", "drops_cancelled_audio", "truncate_needs_audio_item"]
      .filter((k) => c[k]).map((k) => k.replace(/_/g, " "));
    const head = c.version === "unknown" ? "unknown (as 0.30)" : "vLLM-Omni " + c.version;
    return head + " (" + c.source + ")" + (flags.length ? ": " + flags.join(", ") : "");
  }

  function renderSummary(s) {
    const prev = state.previous;
    const dt = prev ? s.monotonic - prev.monotonic : 0;
    const per = (now, before) => (dt > 0 ? Math.max(0, now - before) / dt : 0);

    const tbody = $("engines").tBodies[0];
    tbody.replaceChildren(...s.engines.map((e) => {
      const tr = el("tr");
      tr.appendChild(el("td", e.kind));
      // A replica whose engine said it is full admits nothing for engine_full_backoff.
      const full = e.engine_full_for_seconds > 0 ? " (full, " + duration(e.engine_full_for_seconds) + ")" : "";
      tr.appendChild(el("td", e.state + full, "state-" + e.state));
      tr.appendChild(el("td", duration(e.uptime_seconds)));
      tr.appendChild(el("td", e.restarts));
      const failure = e.last_failure ? e.last_failure + " (" + clock(e.last_failure_at) + ")" : "–";
      const td = el("td", failure);
      td.title = e.last_failure || "";
      tr.appendChild(td);
      return tr;
    }));

    // docs/design.md, Usage: one row per key name from the key file (never the key).
    $("usage").tBodies[0].replaceChildren(...(s.usage || []).map((u) => {
      const tr = el("tr");
      const seconds = (v) => (v || 0).toFixed(1) + " s";
      for (const cell of [
        u.key, u.sessions, duration(u.session_seconds), seconds(u.audio_in_seconds),
        seconds(u.audio_out_seconds), seconds(u.audio_delivered_seconds), seconds(u.audio_heard_seconds),
        u.responses_started, u.responses_cancelled, (u.input_tokens || 0) + " / " + (u.output_tokens || 0),
      ]) tr.appendChild(el("td", cell));
      return tr;
    }));

    // docs/design.md, Quotas: limit and use per key name; 0 = no limit ("∞").
    const q = s.quota || { keys: [] };
    $("quota-backend").textContent = q.backend === "redis"
      ? "(shared in Redis, counted by this sidecar" + (q.state === "ok" ? ")" : "; Redis down: limits per process)")
      : "(this sidecar's own counts)";
    $("quota").tBodies[0].replaceChildren(...(q.keys || []).map((k) => {
      const tr = el("tr");
      const of = (used, limit) => used + " / " + (limit || "∞");
      const day = k.audio_seconds_per_day;
      const left = day ? Math.max(0, day - k.audio_seconds_today).toFixed(1) + " s" : "∞";
      for (const cell of [
        k.key, of(k.sessions, k.max_sessions), of(k.sessions_this_minute, k.sessions_per_minute),
        of(k.audio_seconds_today.toFixed(1) + " s", day ? day + " s" : 0), left,
      ]) tr.appendChild(el("td", cell));
      return tr;
    }));

    const live = s.sessions.live;
    const limit = s.sessions.limit;
    setBar($("sessions-fill"), live, limit || Math.max(live, 1));
    $("sessions-text").textContent = live + " / " + (limit || "∞");
    setBar($("pending-fill"), s.pending.bytes, s.pending.cap_bytes);
    $("pending-text").textContent = bytes(s.pending.bytes) + " / " + bytes(s.pending.cap_bytes);

    const t = s.totals;
    const p = prev ? prev.totals : t;
    const rows = [
      ["events/s client → engine", rate(per(t.events.client_to_upstream, p.events.client_to_upstream))],
      ["events/s engine → client", rate(per(t.events.upstream_to_client, p.events.upstream_to_client))],
      ["overflows", sum(t.overflows)],
      ["cancels", t.cancels],
      ["stale audio dropped", t.stale_audio_dropped + " events"],
      ["sessions started", s.sessions.started],
      ["sessions rejected", sum(s.sessions.rejected)],
      ["ready", s.ready ? "yes" : "no: " + (s.not_ready_reason || "")],
      ["engine behaviour", engineBehaviour(s.engine_capabilities)],
    ];
    $("totals").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));

    let dropsPerSecond = 0;
    const dropRows = Object.keys(t.dropped_events).map((reason) => {
      const r = per(t.dropped_events[reason], p.dropped_events[reason] || 0);
      dropsPerSecond += r;
      return [el("dt", reason), el("dd", rate(r) + "  (" + t.dropped_events[reason] + " total)")];
    });
    $("drops").replaceChildren(...dropRows.flat());

    state.budget = s.budget;
    state.history.push({ t: s.monotonic, sessions: live, pending: s.pending.bytes, drops: dropsPerSecond });
    while (state.history.length && state.history[0].t < s.monotonic - HISTORY_SECONDS) state.history.shift();
    state.previous = s;
    drawChart();
  }

  // -- chart -----------------------------------------------------------------------------

  function drawChart() {
    const canvas = $("chart");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 1200;
    const height = canvas.clientHeight || 220;
    if (canvas.width !== Math.round(width * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const h = state.history;
    const series = [
      ["sessions", (x) => x.sessions, (v) => v.toFixed(0)],
      ["pending bytes", (x) => x.pending, bytes],
      ["drops/s", (x) => x.drops, (v) => v.toFixed(1)],
    ];
    const legend = $("legend");
    const now = h.length ? h[h.length - 1].t : 0;
    const pad = 6;
    ctx.strokeStyle = "#2a3540";
    ctx.lineWidth = 1;
    for (let m = 0; m <= 10; m += 2) {
      const x = pad + (width - 2 * pad) * (1 - (m * 60) / HISTORY_SECONDS);
      ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, height); ctx.stroke();
      ctx.fillStyle = "#8a96a3";
      ctx.fillText(m === 0 ? "now" : "-" + m + " min", Math.min(x + 2, width - 30), height - 4);
    }
    legend.replaceChildren(...series.map(([name, get, fmt], i) => {
      const max = Math.max(0, ...h.map(get));
      const span = el("span");
      span.appendChild(el("i", null, "c" + i));
      span.appendChild(document.createTextNode(name + " (max " + fmt(max) + ")"));
      if (h.length > 1) {
        ctx.strokeStyle = COLORS[i];
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        h.forEach((point, j) => {
          const x = pad + (width - 2 * pad) * (1 - (now - point.t) / HISTORY_SECONDS);
          const y = height - 16 - (height - 28) * (max > 0 ? get(point) / max : 0);
          if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
        });
        ctx.stroke();
      }
      return span;
    }));
  }

  // -- sessions --------------------------------------------------------------------------

  function dropsText(dropped) {
    const parts = Object.keys(dropped || {}).map((r) => r + ": " + dropped[r].events);
    return parts.length ? parts.join(", ") : "–";
  }

  function sortValue(s, key) {
    if (key === "playback_lead_ms") return s.playback_lead_ms === null ? -1 : s.playback_lead_ms;
    if (key === "drops") return Object.values(s.dropped || {}).reduce((a, d) => a + d.events, 0);
    const v = s[key];
    return v === null || v === undefined ? "" : v;
  }

  function renderSessions(page) {
    state.page = page;
    const needle = $("filter").value.trim().toLowerCase();
    let rows = page.sessions;
    if (needle) {
      rows = rows.filter((s) => [s.id, s.upstream_session_id, s.client_address, s.state,
        s.active_response, dropsText(s.dropped)].some((v) => String(v || "").toLowerCase().includes(needle)));
    }
    const key = state.sortKey;
    const sign = state.sortDesc ? -1 : 1;
    rows = rows.slice().sort((a, b) => {
      const x = sortValue(a, key), y = sortValue(b, key);
      return (x < y ? -1 : x > y ? 1 : 0) * sign;
    });
    const more = page.total > page.sessions.length ? " (first " + page.sessions.length + " of " + page.total + ")" : "";
    $("sessions-count").textContent = rows.length + " shown, " + page.live + " live" + more;
    const budget = page.budget;
    $("sessions").tBodies[0].replaceChildren(...rows.map((s) => {
      const tr = el("tr");
      tr.dataset.id = s.id;
      tr.appendChild(el("td", s.id, "mono"));
      tr.appendChild(el("td", s.upstream_session_id || "–", "mono"));
      // A phone call (the /v1/twilio front door) says so next to its address.
      const phone = s.front_door === "twilio" ? " (phone)" : "";
      tr.appendChild(el("td", (s.client_address || "–") + phone, "mono"));
      tr.appendChild(el("td", duration(s.age_seconds)));
      tr.appendChild(el("td", s.state + held(s), "state-" + (s.detached ? "held" : s.state)));
      tr.appendChild(el("td", s.active_response || "–", "mono"));
      tr.appendChild(barCell(s.pending_bytes, budget.pending_bytes, bytes(s.pending_bytes)));
      tr.appendChild(barCell(s.pending_events, budget.pending_events, String(s.pending_events)));
      tr.appendChild(el("td", s.tombstones));
      tr.appendChild(el("td", s.playback_lead_ms === null || s.playback_lead_ms === undefined
        ? "–" : (s.playback_lead_ms / 1000).toFixed(2) + " s"));
      const drops = el("td", dropsText(s.dropped), "drops");
      tr.appendChild(drops);
      tr.addEventListener("click", () => openDetail(s.id));
      return tr;
    }));
    document.querySelectorAll("#sessions th").forEach((th) => {
      th.classList.toggle("sorted-asc", th.dataset.key === key && !state.sortDesc);
      th.classList.toggle("sorted-desc", th.dataset.key === key && state.sortDesc);
    });
  }

  // A session whose client dropped, held for a resume: how much of its grace is left.
  function held(s) {
    return s.detached ? " (held, " + Math.ceil(s.resume_grace_left_seconds) + " s left)" : "";
  }

  // -- detail ----------------------------------------------------------------------------

  function openDetail(id) {
    state.detailId = id;
    $("detail-card").classList.remove("hidden");
    refreshDetail();
  }

  async function refreshDetail() {
    const id = state.detailId;
    if (id === null) return;
    let data;
    try {
      data = await getJSON("/debug/sessions/" + encodeURIComponent(id));
    } catch (err) {
      $("detail-id").textContent = id + " (gone)";
      return;
    }
    const s = data.session;
    $("detail-id").textContent = s.id + (data.live ? "" : " (ended)");
    const fields = [
      ["engine session", s.upstream_session_id || "–"],
      ["client", s.client_address || "–"],
      ["front door", s.front_door || "realtime"],
      ["started", clock(s.started_at)],
      ["age", duration(s.age_seconds)],
      ["state", s.state + held(s)],
      ["client connection", s.detached
        ? "dropped: held for a resume, " + s.resume_grace_left_seconds.toFixed(1) + " s of grace left"
        : "attached"],
      ["outcome", s.outcome || "–"],
      ["close code", s.close_code === null || s.close_code === undefined ? "–" : s.close_code],
      ["active response", s.active_response || "–"],
      ["pending", bytes(s.pending_bytes) + ", " + s.pending_events + " events"],
      ["peak pending", bytes(s.peak_pending_bytes)],
      ["cancels", s.cancels],
      ["overflows", s.overflows],
      ["tombstones", s.tombstones],
      ["playback lead", s.playback_lead_ms === null || s.playback_lead_ms === undefined
        ? "– (pacing off)" : (s.playback_lead_ms / 1000).toFixed(2) + " s"],
      ["drops", dropsText(s.dropped)],
      ["bytes client → engine", bytes(s.bytes_client_to_upstream)],
      ["bytes engine → client", bytes(s.bytes_upstream_to_client)],
    ];
    $("detail-fields").replaceChildren(...fields.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
    $("detail-events").tBodies[0].replaceChildren(...(s.events || []).slice().reverse().map((e) => {
      const tr = el("tr");
      tr.appendChild(el("td", clock(e.at), "mono"));
      tr.appendChild(el("td", e.kind));
      tr.appendChild(el("td", e.detail, "mono"));
      return tr;
    }));
  }

  // -- loop ------------------------------------------------------------------------------

  async function tick() {
    try {
      const [summary, page] = await Promise.all([getJSON("/debug/summary"), getJSON("/debug/sessions")]);
      renderSummary(summary);
      renderSessions(page);
      await refreshDetail();
      const status = $("status");
      status.textContent = summary.ready ? "ready" : "not ready";
      status.className = "status " + (summary.ready ? "ok" : "bad");
      $("updated").textContent = "updated " + clock(summary.time);
    } catch (err) {
      const status = $("status");
      status.textContent = "cannot reach the sidecar: " + err.message;
      status.className = "status bad";
    } finally {
      setTimeout(tick, POLL_MS);
    }
  }

  function start() {
    document.querySelectorAll("#sessions th").forEach((th) => {
      th.addEventListener("click", () => {
        if (state.sortKey === th.dataset.key) state.sortDesc = !state.sortDesc;
        else { state.sortKey = th.dataset.key; state.sortDesc = false; }
        renderSessions(state.page);
      });
    });
    $("filter").addEventListener("input", () => renderSessions(state.page));
    $("detail-close").addEventListener("click", () => {
      state.detailId = null;
      $("detail-card").classList.add("hidden");
    });
    tick();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
