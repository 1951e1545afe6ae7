"""The tokenize stage: text documents -> packed token blocks in memory-mapped Arrow."""
