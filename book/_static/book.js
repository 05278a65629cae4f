/* The book's own page script (loaded on every page through _config.yml's html_js_files).
 *
 * 1. Sidebar toggles. pydata-sphinx-theme 0.17 wires its sidebar dialogs to the FIRST
 *    `.primary-toggle` / `.secondary-toggle` of the page, which is its own header button;
 *    sphinx-book-theme 1.3 hides that header and shows its own buttons in the article header,
 *    which nothing listens to: below 992 px the chapter list and the page contents could not
 *    be opened. A click on any other toggle is forwarded to the wired one, which opens the
 *    dialog on a narrow screen and collapses the sidebar on a wide one (the book theme's
 *    handler on that button).
 * 2. Long output lines: a cell output that is wider than the page because of a few long lines
 *    (a repr, an error message) is wrapped; one whose lines are mostly too long (a table)
 *    keeps its columns and scrolls.
 * 3. Printing: closed dropdowns (answers, hidden exercise cells) are opened for the printout
 *    and closed again afterwards.
 */
(function () {
  "use strict";

  document.addEventListener(
    "click",
    function (event) {
      var button = event.target.closest && event.target.closest(".primary-toggle, .secondary-toggle");
      if (!button) return;
      var kind = button.classList.contains("primary-toggle") ? ".primary-toggle" : ".secondary-toggle";
      var wired = document.querySelector(kind);
      if (!wired || wired === button) return;
      event.preventDefault();
      event.stopPropagation();
      wired.click();
    },
    true,
  );

  function wrapLongOutputs() {
    document.querySelectorAll(".cell_output pre").forEach(function (pre) {
      if (pre.scrollWidth - pre.clientWidth <= 1) return;
      var lines = pre.textContent.replace(/\n$/, "").split("\n");
      var longest = Math.max.apply(null, lines.map(function (l) { return l.length; }));
      var style = getComputedStyle(pre);
      var inner = pre.scrollWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      var fits = Math.floor(((pre.clientWidth - parseFloat(style.paddingLeft)
                              - parseFloat(style.paddingRight)) * longest) / inner);
      var tooLong = lines.filter(function (l) { return l.length > fits; }).length;
      if (tooLong <= 2 || tooLong < lines.length / 2) pre.classList.add("kv-wrap");
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", wrapLongOutputs);
  } else {
    wrapLongOutputs();
  }

  var openedForPrint = [];
  window.addEventListener("beforeprint", function () {
    openedForPrint = Array.prototype.filter.call(
      document.querySelectorAll("details:not([open])"),
      function (d) { d.open = true; return true; },
    );
  });
  window.addEventListener("afterprint", function () {
    openedForPrint.forEach(function (d) { d.open = false; });
    openedForPrint = [];
  });
})();
