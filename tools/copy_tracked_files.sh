# Sourced by the tools that build in a scratch copy of the repository:
#   copy_tracked_files REPO DESTINATION
# copies the files git tracks in REPO, as they are in the working tree, into DESTINATION (which
# must exist), keeping their paths: no build output, virtual environment or cache comes along.
copy_tracked_files() {
  git -C "$1" ls-files -z | (cd "$1" && xargs -0 cp --parents -t "$2")
}
