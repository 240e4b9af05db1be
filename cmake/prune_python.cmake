# cmake -DSRC=<python/graft> -DDST=<build/python/graft> -P prune_python.cmake
#
# Removes from the build's copy of the package every module the source no longer has, with its
# byte code: `copy_directory` only adds and overwrites, so a module moved out of python/graft (or
# deleted) would otherwise stay importable from build/python. The compiled module (_graft*.so),
# which the build writes there itself, is left alone.
file(GLOB built RELATIVE "${DST}" "${DST}/*.py")
foreach(f IN LISTS built)
  if(NOT EXISTS "${SRC}/${f}")
    get_filename_component(stem "${f}" NAME_WE)
    file(GLOB pyc "${DST}/__pycache__/${stem}.*.pyc")
    file(REMOVE "${DST}/${f}" ${pyc})
    message(STATUS "build/python: removed stale ${f}")
  endif()
endforeach()
