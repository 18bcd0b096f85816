# Sourced by the launch scripts. The CUDA caching allocator's expandable segments (memory mapped
# into segments that grow, instead of fixed-size blocks) keep a training step's changing tensor
# sizes from fragmenting GPU memory. torch >= 2.9 reads PYTORCH_ALLOC_CONF first and calls the
# older name deprecated; older torch reads only PYTORCH_CUDA_ALLOC_CONF. Both are set, so every
# torch takes it and none warns, unless the user set either: then both are left as they are.
if [[ -z ${PYTORCH_ALLOC_CONF:-} && -z ${PYTORCH_CUDA_ALLOC_CONF:-} ]]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
