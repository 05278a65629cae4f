// Search ranking (Sphinx's html_search_scorer, set by book/_ext/book_search.py).
//
// Sphinx scores a page by its best single query word: a word in any section title counts as
// much as the page's own title, so "radix tree" ranked "Integrity" (a section title with
// "tree", "radix" in its text) level with "The radix tree", and ties go alphabetically. Here a
// result whose page title (or section title) holds every word of the query comes first, above
// index entries too (a glossary term scores up to 100 for an exact match, which would put the
// glossary above the chapter that teaches the term).
var Scorer = {
  score: (result) => {
    const [docname, title, anchor, descr, score, filename] = result;
    const query = new URLSearchParams(window.location.search).get("q") || "";
    // a Chinese word (驱逐, 基数树) counts however short; an English one from three letters
    const words = query.toLowerCase().split(/\s+/).filter((w) => w.length > 2 || /[\u4e00-\u9fff]/.test(w));
    const plain = (title || "").replace(/<[^>]*>/g, "").toLowerCase();
    const section = plain.includes(" > ") ? plain.split(" > ").pop() : plain;
    if (words.length && words.every((w) => section.includes(w))) return score + (anchor ? 120 : 130);
    return score;
  },
  // Sphinx's defaults for everything else
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: { 0: 15, 1: 5, 2: -5 },
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};
