// The console's only script (served as /static/console.js; the CSP allows no inline one).
// - Listens to /events (server-sent events from the console's one shared feed) and, on a
//   change, re-fetches each [data-refresh] element's URL (it carries fragment=1) and puts
//   what comes back in its place, at most every 500 ms. No polling loop.
// - "reload" (this page fell behind the feed) reloads the page.
// - Fills pre#output from its data-src (/output/NAME): text appended, gaps marked .gap.
// - A form with data-confirm (Abandon) asks before it is sent.
(function () {
  "use strict";
  var DEBOUNCE_MS = 500;
  var MAX_OUTPUT_CHARS = 1 << 20;
  var timer = null;
  var busy = false;
  var again = false;

  function refresh() {
    timer = null;
    if (busy) { again = true; return; }
    var parts = document.querySelectorAll("[data-refresh]");
    if (parts.length === 0) { return; }
    busy = true;
    var pending = parts.length;
    var done = function () {
      pending -= 1;
      if (pending > 0) { return; }
      busy = false;
      if (again) { again = false; schedule(); }
    };
    parts.forEach(function (el) {
      var url = el.getAttribute("data-refresh");
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) {
          if (r.status === 401) { window.location.assign("/login"); return null; }
          return r.ok ? r.text() : null;
        })
        .then(function (html) {
          if (html === null || html === undefined) { return; }
          var t = document.createElement("template");
          t.innerHTML = html.trim();
          var fresh = t.content.firstElementChild;
          if (fresh && el.parentNode) { el.replaceWith(fresh); }
        })
        .catch(function () {})
        .then(done);
    });
  }

  function schedule() {
    if (timer === null) { timer = window.setTimeout(refresh, DEBOUNCE_MS); }
  }

  function listen() {
    if (!window.EventSource || document.querySelector("[data-refresh]") === null) { return; }
    var es = new EventSource("/events");
    es.addEventListener("change", schedule);
    es.addEventListener("reload", function () { es.close(); window.location.reload(); });
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
