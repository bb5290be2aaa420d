// The copy button of a code block with ">>>" examples copies the code only.
//
// mkdocs-material copies a block's `data-copy` attribute when it has one, so each block with
// a line starting with ">>>" gets the text runnableCode returns: its ">>> " lines and the
// "... " lines right after them (the rule doctest uses), without the prompts; output lines
// are dropped, and a blank line goes before a ">>>" line that follows a "..." one so that a
// Python prompt closes the `def` or `with` above it. tests/test_docs.py checks the rule
// against doctest's own parser on every example of the docs.

function runnableCode(text) {
  const lines = text.split("\n");
  if (!lines.some((line) => line.startsWith(">>>"))) return null;
  const code = [];
  let inExample = false;
  let continued = false;
  for (const line of lines) {
    const isSource = line.startsWith(">>> ") || line === ">>>";
    const isMore = inExample && (line.startsWith("... ") || line === "...");
    if (isSource && continued) code.push("");
    if (isSource || isMore) code.push(line.slice(4));
    continued = isMore || (continued && !isSource);
    inExample = isSource || isMore;
  }
  return code.join("\n") + "\n";
}

function markDoctestBlocks() {
  for (const block of document.querySelectorAll("pre > code")) {
    const code = runnableCode(block.textContent);
    if (code !== null) block.setAttribute("data-copy", code);
  }
}

if (typeof document$ !== "undefined") {
  document$.subscribe(markDoctestBlocks);
} else if (typeof document !== "undefined") {
  document.addEventListener("DOMContentLoaded", markDoctestBlocks);
}

if (typeof module !== "undefined") module.exports = { runnableCode };
