(function () {
  var root = document.getElementById(__PLAYER_ID__);
  if (!root || root.getAttribute("data-ready")) { return; }
  root.setAttribute("data-ready", "1");
  var frames = root.querySelectorAll(".kvp-frame");
  var n = frames.length, cur = 0, timer = null;
  var q = function (sel) { return root.querySelector(sel); };
  var prev = q(".kvp-prev"), next = q(".kvp-next"), play = q(".kvp-play"),
      first = q(".kvp-first"), last = q(".kvp-last"), range = q(".kvp-range"),
      count = q(".kvp-count"), caption = q(".kvp-caption");
  function show(i) {
    cur = Math.max(0, Math.min(n - 1, i));
    for (var j = 0; j < n; j++) { frames[j].hidden = (j !== cur); }
    caption.textContent = frames[cur].getAttribute("data-caption");
    count.textContent = (cur + 1) + " / " + n;
    range.value = String(cur);
    root.setAttribute("data-step", String(cur));
    prev.disabled = first.disabled = (cur === 0);
    next.disabled = last.disabled = (cur === n - 1);
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "\u25B6 play";
    root.setAttribute("data-playing", "0");
  }
  function start() {
    if (cur === n - 1) { show(0); }
    play.textContent = "\u275A\u275A pause";
    root.setAttribute("data-playing", "1");
    timer = setInterval(function () {
      if (cur >= n - 1) { stop(); } else { show(cur + 1); }
    }, __INTERVAL_MS__);
  }
  prev.addEventListener("click", function () { stop(); show(cur - 1); });
  next.addEventListener("click", function () { stop(); show(cur + 1); });
  first.addEventListener("click", function () { stop(); show(0); });
  last.addEventListener("click", function () { stop(); show(n - 1); });
  play.addEventListener("click", function () { if (timer === null) { start(); } else { stop(); } });
  range.addEventListener("input", function () { stop(); show(parseInt(range.value, 10)); });
  root.addEventListener("keydown", function (e) {
    if (e.key === "ArrowLeft") { stop(); show(cur - 1); e.preventDefault(); }
    if (e.key === "ArrowRight") { stop(); show(cur + 1); e.preventDefault(); }
  });
  show(0);
})();
