"""The parallel layout on the shared floor: `ParallelDims` (the degrees, the mesh, every size
and rank), the pipeline's micro-batches and where sequence parallel applies."""

from components.parallel.dims import ParallelDims, data_parallel, pipeline_microbatches, sequence_parallel

__all__ = ["ParallelDims", "data_parallel", "pipeline_microbatches", "sequence_parallel"]
