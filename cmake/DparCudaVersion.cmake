# The oldest CUDA dpar's CUDA backend builds with: 12.5, the first with cudaGetDriverEntryPointByVersion, through
# which src/platform/cuda reaches the driver's context calls without linking libcuda.
set(DPAR_CUDA_MINIMUM_VERSION 12.5)

# dpar_check_cuda_version(COMPILER_VERSION TOOLKIT_VERSION WHY_VAR): sets WHY_VAR in the caller to why CUDA cannot
# be used (nvcc or the toolkit it found is older than DPAR_CUDA_MINIMUM_VERSION), or to "" when it can. Both are
# checked: a CMAKE_CUDA_COMPILER and the CUDAToolkit found next to another nvcc may differ.
function(dpar_check_cuda_version compiler_version toolkit_version why_var)
  set(why "")
  if(NOT compiler_version OR compiler_version VERSION_LESS DPAR_CUDA_MINIMUM_VERSION)
    set(why "nvcc ${compiler_version} is older than CUDA ${DPAR_CUDA_MINIMUM_VERSION}, which dpar needs "
            "(cudaGetDriverEntryPointByVersion): point CMAKE_CUDA_COMPILER at a newer toolkit")
  elseif(NOT toolkit_version OR toolkit_version VERSION_LESS DPAR_CUDA_MINIMUM_VERSION)
    set(why "the CUDA toolkit ${toolkit_version} is older than CUDA ${DPAR_CUDA_MINIMUM_VERSION}, which dpar needs "
            "(cudaGetDriverEntryPointByVersion): set CUDAToolkit_ROOT to a newer one")
  endif()
  string(REPLACE ";" "" why "${why}")
  set(${why_var} "${why}" PARENT_SCOPE)
endfunction()
