"""The parallel layout on the shared floor: `ParallelDims` (the degrees, the mesh, every size
and rank) and the pipeline's micro-batches."""

from components.parallel.dims import ParallelDims, data_parallel, pipeline_microbatches

__all__ = ["ParallelDims", "data_parallel", "pipeline_microbatches"]
