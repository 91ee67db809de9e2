"""The xla backend: the portable block-sparse path (`backend`: the block plan's online softmax;
`gather`, `lists`: gathered tiles of chosen blocks; `paged`, `paged_items`: the paged kernel)."""
