"""Sphinx configuration: the guides (MyST Markdown) and the API reference from the docstrings.

`make docs` builds it offline with warnings as errors and every cross-reference checked.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "splash_hk"
author = "the splash_hk authors"
copyright = "2026, the splash_hk authors"  # pylint: disable=redefined-builtin

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "member-order": "bysource", "undoc-members": False}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a dataclass's "Attributes:" as fields of its class, not again as members

# Every reference to a splash_hk name must resolve. References to other projects' names
# (jax, numpy, haiku, flax, the standard library) are not checked: the build is offline, so
# their inventories (intersphinx) cannot be fetched.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|np|numpy|haiku|hk|flax|nnx|chex|typing|collections|enum|types)(\..*)?"),
    (r"py:.*", r"(int|float|bool|str|bytes|object|tuple|list|dict|None|Any|Callable|Sequence"
               r"|Mapping|Iterable|Iterator|Literal|NamedTuple|Optional|Union|ClassVar|Hashable)"),
    # Our own aliases as signatures spell them (`Shaped`, `Leaf`, `_objects.Mask`): Sphinx looks
    # such a name up in the module it documents, not where it was imported from. Each is
    # documented once, under its full name, in api.md ("Extension points").
    (r"py:class", r"(Shaped|Leaf|_objects\.Mask)"),
]

html_theme = "alabaster"
html_title = "splash_hk"
html_static_path: list[str] = []
