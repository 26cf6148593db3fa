# deformconv_sources(<variable> <build>...): the lines of csrc/sources.txt tagged with any of
# the builds, as paths relative to the repository root; and DEFORMCONV_COMPILE_FLAGS, the C++
# flags of csrc/compile_flags.txt. setup.py reads both files too.
set(_deformconv_root "${CMAKE_CURRENT_LIST_DIR}/..")

function(deformconv_sources variable)
  file(STRINGS "${_deformconv_root}/csrc/sources.txt" lines REGEX "^csrc/")
  set(chosen "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "[ \t]+" ";" fields "${line}")
    list(POP_FRONT fields path)
    foreach(build IN LISTS ARGN)
      if(build IN_LIST fields)
        list(APPEND chosen "${path}")
        break()
      endif()
    endforeach()
  endforeach()
  set(${variable} "${chosen}" PARENT_SCOPE)
endfunction()

file(STRINGS "${_deformconv_root}/csrc/compile_flags.txt" DEFORMCONV_COMPILE_FLAGS REGEX "^-")
