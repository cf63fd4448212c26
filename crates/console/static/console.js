// The console's only script (served as /static/console.js; the CSP allows no inline one).
// - Listens to /events (server-sent events from the console's one shared feed) and, on a
//   change, re-fetches each [data-refresh] element's URL (it carries fragment=1) and puts
//   what comes back in its place, at most every 500 ms. No polling loop.
// - Says in the header (#liveness) two facts apart: the connection (connecting, connected,
//   reconnecting and why) and how old the data shown is ("updated 4s ago", marked stale past
//   data-stale-after-ms). The data counts as current as of a refresh that brought it (less
//   its data-age-ms), or of an `alive` event saying the feed is up while no change waits.
//   So connected with stale data (a refresh that fails, a console that lost the feed) shows.
// - A broken stream (an error, or nothing heard for three `alive` periods) is closed and
//   opened again with backoff (0.5 s doubling to 5 s); a HEAD /events says why, if it can.
//   Once it is open again every part is re-fetched: events missed meanwhile are not replayed.
//   The first one opens with ?after=data-changes, so a change between the page's fetch and
//   the stream is told at once.
// - "reload" (this page fell behind the feed) reloads the page.
// - Fills pre#output from its data-src (/output/NAME): text appended, gaps marked .gap.
// - A form with data-confirm (Abandon) asks before it is sent.
(function () {
  "use strict";
  var DEBOUNCE_MS = 500;
  var RETRY_MS = 2000;
  var MAX_OUTPUT_CHARS = 1 << 20;
  var timer = null;
  var busy = false;
  var again = false;

  // The stream and what the header says from it.
  var live = {
    es: null,
    generation: 0,
    connected: false,
    openedOnce: false,
    why: "",
    feedDown: "",
    heard: 0,
    asOf: Date.now(),
    after: null,
    changes: 0,
    pending: false,
    failure: "",
    attempt: 0,
    probes: 0,
    aliveMs: 2000,
    staleMs: 10000
  };

  function ageOf(el) {
    var n = Number(el && el.getAttribute("data-age-ms"));
    return isFinite(n) && n > 0 ? n : 0;
  }

  // As the server writes durations: 42s, 5m 3s, 2h 5m, 3d 4h.
  function duration(ms) {
    var s = Math.floor(Math.max(0, ms) / 1000);
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m " + (s % 60) + "s"; }
    if (s < 86400) { return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m"; }
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  // Text only changes when it differs: a status region is announced on each change.
  function put(el, text) {
    if (el && el.textContent !== text) { el.textContent = text; }
  }

  function show() {
    var conn = document.getElementById("connection");
    var fresh = document.getElementById("freshness");
    if (!conn || !fresh) { return; }
    var state, text;
    if (live.connected && !live.feedDown) {
      state = "connected"; text = "connected";
    } else if (live.connected) {
      state = "reconnecting";
      text = "reconnecting (the console lost the coordinator's events: " + live.feedDown + ")";
    } else if (!live.openedOnce && !live.why) {
      state = "connecting"; text = "connecting";
    } else {
      state = "reconnecting"; text = "reconnecting (" + (live.why || "the live stream broke") + ")";
    }
    conn.setAttribute("data-state", state);
    put(conn, text);
    conn.hidden = false;
    var ms = Date.now() - live.asOf;
    var stale = ms >= live.staleMs;
    fresh.setAttribute("data-state", stale ? "stale" : "fresh");
    put(document.getElementById("stale"), stale ? "stale" : "");
    put(document.getElementById("age"), "updated " + duration(ms) + " ago" +
      (live.failure ? "; refresh failed (" + live.failure + ")" : ""));
    fresh.hidden = false;
  }

  // A refresh ended: `asOf` is when the oldest part it brought was fetched; `failed` why one
  // part did not come ("" when all did).
  function refreshed(changes, asOf, failed) {
    if (failed) {
      live.failure = failed;
      live.pending = true;
      if (live.connected) { window.setTimeout(schedule, RETRY_MS); }
    } else {
      live.failure = "";
      if (asOf > live.asOf && asOf !== Infinity) { live.asOf = asOf; }
      if (changes === live.changes) { live.pending = false; }
    }
    show();
  }

  function refresh() {
    timer = null;
    if (busy) { again = true; return; }
    var parts = document.querySelectorAll("[data-refresh]");
    if (parts.length === 0) { return; }
    busy = true;
    var changes = live.changes;
    var pending = parts.length;
    var oldest = Infinity;
    var failed = "";
    var done = function () {
      pending -= 1;
      if (pending > 0) { return; }
      busy = false;
      refreshed(changes, oldest, failed);
      if (again) { again = false; schedule(); }
    };
    parts.forEach(function (el) {
      var url = el.getAttribute("data-refresh");
      var got = 0;
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) {
          got = Date.now();
          if (r.status === 401) {
            failed = "signed out";
            window.location.assign("/login");
            return null;
          }
          if (!r.ok) { failed = "the console answered HTTP " + r.status; return null; }
          return r.text();
        })
        .then(function (html) {
          if (html === null || html === undefined) { return; }
          var t = document.createElement("template");
          t.innerHTML = html.trim();
          var fresh = t.content.firstElementChild;
          if (fresh && el.parentNode) { el.replaceWith(fresh); }
          oldest = Math.min(oldest, got - ageOf(fresh));
        })
        .catch(function () { failed = failed || "the console does not answer"; })
        .then(done);
    });
  }

  function schedule() {
    if (timer === null) { timer = window.setTimeout(refresh, DEBOUNCE_MS); }
  }

  // Why the stream cannot open, as far as the browser can tell: HEAD /events answers as
  // GET would (401 signed out, 429 too many streams), or not at all.
  function probe(kept) {
    var n = ++live.probes;
    var ctl = window.AbortController ? new window.AbortController() : null;
    var cut = ctl ? window.setTimeout(function () { ctl.abort(); }, 5000) : null;
    fetch("/events", { method: "HEAD", credentials: "same-origin", cache: "no-store",
      signal: ctl ? ctl.signal : undefined })
      .then(function (r) {
        if (r.status === 401) { window.location.assign("/login"); return "signed out"; }
        if (r.status === 429) { return "too many live streams open: close some console pages"; }
        if (r.ok) { return kept || "the live stream broke"; }
        return "the console answered HTTP " + r.status;
      }, function () {
        return navigator.onLine === false ? "this browser is offline" : "the console does not answer";
      })
      .then(function (why) {
        if (cut !== null) { window.clearTimeout(cut); }
        if (n === live.probes && !live.connected) { live.why = why; show(); }
      });
  }

  // The stream is gone (or silent): close it, say so, find out why, open it again later.
  function broke(why) {
    var es = live.es;
    live.es = null;
    live.generation += 1;
    if (es) { es.close(); }
    live.connected = false;
    live.why = why || live.why || "the live stream broke";
    show();
    probe(why);
    var wait = Math.min(500 * Math.pow(2, live.attempt), 5000);
    live.attempt += 1;
    window.setTimeout(connect, wait + Math.random() * wait / 4);
  }

  function connect() {
    var gen = ++live.generation;
    // The first time, where the feed stood when the page's data was fetched: a change since
    // is told at once. Later, the console may be another process: everything is re-fetched.
    var after = live.openedOnce ? null : live.after;
    var es = new EventSource(after === null ? "/events" : "/events?after=" + after);
    live.es = es;
    var mine = function (f) {
      return function (ev) { if (gen === live.generation) { f(ev); } };
    };
    es.addEventListener("open", mine(function () {
      live.connected = true;
      live.attempt = 0;
      live.why = "";
      live.feedDown = "";
      live.heard = Date.now();
      // Whatever changed while the stream was down: events are not replayed. (Since the page
      // was fetched, the console says: `after` below.)
      if (live.openedOnce) {
        live.changes += 1;
        live.pending = true;
        if (timer !== null) { window.clearTimeout(timer); timer = null; }
        refresh();
      }
      live.openedOnce = true;
      show();
    }));
    es.addEventListener("change", mine(function () {
      live.heard = Date.now();
      live.changes += 1;
      live.pending = true;
      schedule();
    }));
    es.addEventListener("alive", mine(function (ev) {
      live.heard = Date.now();
      var m = {};
      try { m = JSON.parse(ev.data); } catch (e) { m = {}; }
      live.feedDown = m.feed === "down" ? String(m.why || "no reason given") : "";
      // Nothing changed since the last refresh, and the feed would have said: still current.
      if (!live.feedDown && !live.pending && !busy && !live.failure) { live.asOf = Date.now(); }
      show();
    }));
    es.addEventListener("reload", mine(function () { es.close(); window.location.reload(); }));
    es.addEventListener("error", mine(function () { broke(""); }));
  }

  function tick() {
    var quiet = Date.now() - live.heard;
    if (live.connected && quiet > 3 * live.aliveMs + 1000) {
      broke("nothing heard from the console for " + duration(quiet));
      return;
    }
    show();
  }

  function listen() {
    var parts = document.querySelectorAll("[data-refresh]");
    var bar = document.getElementById("liveness");
    if (parts.length === 0) { return; }
    if (!window.EventSource) {
      put(document.getElementById("connection"), "not live: this browser has no EventSource");
      return;
    }
    if (bar) {
      live.aliveMs = Number(bar.getAttribute("data-alive-ms")) || live.aliveMs;
      live.staleMs = Number(bar.getAttribute("data-stale-after-ms")) || live.staleMs;
    }
    var oldest = 0;
    parts.forEach(function (el) {
      oldest = Math.max(oldest, ageOf(el));
      var n = el.getAttribute("data-changes");
      if (n !== null && /^[0-9]+$/.test(n) && (live.after === null || Number(n) < live.after)) {
        live.after = Number(n);
      }
    });
    live.asOf = Date.now() - oldest;
    connect();
    show();
    window.setInterval(tick, 1000);
    // Back from the browser's page cache: the stream is long gone.
    window.addEventListener("pageshow", function (ev) {
      if (ev.persisted) { live.attempt = 0; broke("the page was restored from the browser's cache"); }
    });
  }

  function marker(pre, text) {
    var span = document.createElement("span");
    span.className = "gap";
    span.textContent = text;
    pre.appendChild(span);
  }

  function trim(pre) {
    while (pre.textContent.length > MAX_OUTPUT_CHARS && pre.firstChild) {
      pre.removeChild(pre.firstChild);
    }
  }

  function output() {
    var pre = document.getElementById("output");
    var status = document.getElementById("output-status");
    if (!pre || !window.EventSource) { return; }
    var src = pre.getAttribute("data-src");
    if (!src) { return; }
    var es = new EventSource(src);
    var opened = false;
    // A reconnect tails the run again from what is kept: start the panel afresh.
    es.addEventListener("open", function () {
      if (opened) { pre.textContent = ""; }
      opened = true;
    });
    var say = function (text) { if (status) { status.textContent = text; } };
    var chunk = function (ev) {
      var m;
      try { m = JSON.parse(ev.data); } catch (e) { return; }
      if (m.skipped > 0) { marker(pre, "\n[… " + m.skipped + " bytes not kept …]\n"); }
      if (m.text) { pre.appendChild(document.createTextNode(m.text)); }
      trim(pre);
      if (m.worker) { say("running on " + m.worker + (m.phase ? " (" + m.phase + ")" : "")); }
      pre.scrollTop = pre.scrollHeight;
      return m;
    };
    es.addEventListener("output", chunk);
    es.addEventListener("ended", function (ev) {
      var m = chunk(ev);
      marker(pre, "\n[output ended" + (m && m.end_reason ? ": " + m.end_reason : "") + "]\n");
      say("ended");
      es.close();
    });
    es.addEventListener("error", function (ev) {
      if (typeof ev.data === "string" && ev.data.length > 0) { say(ev.data); es.close(); }
    });
  }

  // On the document: forms replaced by a refresh are covered too.
  function confirmations() {
    document.addEventListener("submit", function (ev) {
      var form = ev.target;
      var ask = form && form.getAttribute ? form.getAttribute("data-confirm") : null;
      if (ask && !window.confirm(ask)) { ev.preventDefault(); }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    confirmations();
    listen();
    output();
  });
})();
