/* GPUFlex console: live refresh by polling (progressive enhancement only).
 * A page opts in with <body data-poll="SECONDS">; every element carrying a
 * data-live="NAME" attribute is replaced by its counterpart from a fresh copy
 * of the same page. Without JavaScript the pages work the same, just static.
 * A <details data-key="KEY"> the reader opened stays open across a refresh.
 * No inline code anywhere: the Content-Security-Policy forbids it. */
(function () {
  "use strict";
  var body = document.body;
  var every = parseFloat(body && body.getAttribute("data-poll"));
  if (!every || every < 1 || !window.fetch || !window.DOMParser) { return; }
  var busy = false;
  function keysOfOpen(root) {
    var keys = {};
    var open = root.querySelectorAll("details[open][data-key]");
    for (var i = 0; i < open.length; i++) { keys[open[i].getAttribute("data-key")] = true; }
    return keys;
  }
  function reopen(root, keys) {
    var all = root.querySelectorAll("details[data-key]");
    for (var i = 0; i < all.length; i++) {
      if (keys[all[i].getAttribute("data-key")]) { all[i].open = true; }
    }
  }
  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(window.location.href, {
      credentials: "same-origin",
      headers: { "X-GPUFlex-Poll": "1" },
      cache: "no-store",
      redirect: "error"
    }).then(function (r) {
      if (!r.ok) { throw new Error("status " + r.status); }
      return r.text();
    }).then(function (html) {
      var fresh = new DOMParser().parseFromString(html, "text/html");
      var parts = document.querySelectorAll("[data-live]");
      for (var i = 0; i < parts.length; i++) {
        var name = parts[i].getAttribute("data-live");
        var next = fresh.querySelector('[data-live="' + name.replace(/["\\]/g, "") + '"]');
        if (next && next.innerHTML !== parts[i].innerHTML) {
          var opened = keysOfOpen(parts[i]);
          parts[i].innerHTML = next.innerHTML;
          reopen(parts[i], opened);
        }
      }
      var stamp = document.getElementById("live-status");
      if (stamp) { stamp.textContent = "updated " + new Date().toLocaleTimeString(); }
    }).catch(function () {
      var stamp = document.getElementById("live-status");
      if (stamp) { stamp.textContent = "live updates paused (reload the page)"; }
    }).then(function () { busy = false; });
  }
  window.setInterval(refresh, every * 1000);
  document.addEventListener("visibilitychange", refresh);
})();
