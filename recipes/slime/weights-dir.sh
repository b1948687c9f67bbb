# Sourced by the *.common.sh scripts. check_weights_dir DIR HF_CHECKPOINT: make the weights
# directory; one in a node's memory (tmpfs, e.g. /dev/shm) must have room for WEIGHT_VERSIONS
# (default 4: K = 2 live versions, the one loading, the one being written) checkpoints of the
# model's size, or the launch stops here instead of slime's checkpoint write failing mid-run.
check_weights_dir() {
   local dir=$1 model=$2 versions=${WEIGHT_VERSIONS:-4} need free
   mkdir -p "${dir}"
   [[ "$(stat -f -c %T "${dir}")" == tmpfs && -d "${model}" ]] || return 0
   # -L: a model dir that is a symlink, or holds symlinks (a Hugging Face cache snapshot), counts its files.
   need=$(( $(du -skL "${model}" | cut -f1) * versions ))
   free=$(df -Pk "${dir}" | awk 'NR == 2 {print $4}')
   if (( free < need )); then
      echo "WEIGHTS_DIR=${dir} is tmpfs with ${free} KB free; ${versions} versions of ${model} need ${need} KB:" \
           "enlarge it (docker run --shm-size) or leave WEIGHTS_DIR on disk" >&2
      exit 1
   fi
}
