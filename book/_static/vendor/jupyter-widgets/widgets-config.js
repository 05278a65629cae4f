// Loaded after require.js and before embed-amd.js (see nb_ipywidgets_js in _config.yml).
// The ipywidgets HTML manager finds its icon fonts from the URL of its own AMD module,
// "@jupyter-widgets/html-manager/dist/libembed-amd", which require.js would resolve relative
// to the page; map that module path to the folder this script was loaded from, where the
// vendored embed-amd.js and its fonts live.
(function () {
  var base = document.currentScript.src.replace(/\/[^/]*$/, "");
  window.__jupyter_widgets_assets_path__ = base + "/";
  if (window.requirejs) {
    window.requirejs.config({paths: {"@jupyter-widgets/html-manager/dist": base}});
  }
})();
