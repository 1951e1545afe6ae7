"""The evaluate stage: held-out perplexity, bits per byte, throughput, samples, reports."""
