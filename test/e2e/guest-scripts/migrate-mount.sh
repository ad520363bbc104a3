# Live migration while the share is not mounted (TestMigration's premount
# and postumount scenarios); the host answers E2E-ASK migrate-1 with the
# migration's end (completed, failed, cancelled).
#   e2e.migwhen=premount   (with e2e.mount=0) migrate before the first mount,
#                          then mount on the destination and use the share
#   e2e.migwhen=postumount write a file, unmount, migrate, mount again on
#                          the destination, read it back and use the share
# Markers: E2E-MIG-ANSWER n=1 status=S, E2E-MIG-CHECK NAME ok|fail,
# E2E-MIG-END failed=C.
mig_fail=0
check() {
	echo "E2E-MIG-CHECK $*"
	[ "$2" = ok ] || mig_fail=$((mig_fail + 1))
}
seq 1 5000 >/tmp/post.exp
case $E2E_MIGWHEN in
premount) ;;
postumount)
	step write-before cp /tmp/post.exp /mnt/post.txt && check write-before ok || check write-before fail
	step umount-before umount /mnt && check umount-before ok || check umount-before fail
	;;
*)
	check migwhen fail "unknown e2e.migwhen=$E2E_MIGWHEN"
	;;
esac
ans=$(e2e_ask migrate-1)
echo "E2E-MIG-ANSWER n=1 status=${ans%% *}"
step mount-after mount -t virtiofs "$E2E_TAG" /mnt && check mount-after ok || check mount-after fail
if [ "$E2E_MIGWHEN" = postumount ]; then
	step read-after cmp /tmp/post.exp /mnt/post.txt && check read-after ok || check read-after fail
fi
step cat cat /mnt/hello && check cat ok || check cat fail
step fio fio --name=mig --filename=/mnt/fio.dat --size=4M --bs=128k --rw=write --direct=1 \
	--ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 && check fio ok || check fio fail
echo "E2E-MIG-END failed=$mig_fail"
