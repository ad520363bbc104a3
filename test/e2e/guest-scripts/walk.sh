# TestGuestWalk: find, ls -lR and two stat passes over the whole share, one
# after the other, without dropping caches in between (the guest's dentry
# cache keeps every inode it walked looked up, as after a find or a git
# status under --cache auto). Every walk is a step; walk-lib.sh prints
# its E2E-WALK line. The host checks the counts and the errors.
# Kernel parameters: e2e.walkdir=DIR (below /mnt, default the share's root).
. /e2e/scripts/walk-lib.sh
_root=/mnt/${E2E_WALKDIR:-}
step walk-find walk_op find "$_root"
step walk-ls walk_op ls "$_root"
step walk-stat2 walk_op stat2 "$_root"
