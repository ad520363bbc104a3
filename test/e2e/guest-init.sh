#!/bin/sh
# /init of the e2e guest (busybox ash, PID 1). Built into the initramfs by guest.sh.
#
# Kernel command line parameters (every e2e.KEY=VALUE is also exported as E2E_KEY):
#   e2e.tag=TAG        virtio-fs tag to mount on /mnt (default myfs)
#   e2e.script=NAME    run /e2e/scripts/NAME.sh (from test/e2e/guest-scripts) after the mount
#   e2e.mount=0        do not mount (the script does it)
#   e2e.asktimeout=S   seconds e2e_ask waits for the host's answer (default 60)
#
# Console markers (each on a line of its own; the host test parses them):
#   E2E-BOOT kernel=K uptime=U         init started
#   E2E-VIRTIO dev=virtioN device=ID features=BITS
#                                      one per virtio device, every boot, before the
#                                      mount: its device id (0x001a: virtio-fs) and the
#                                      feature bits the driver negotiated, as
#                                      /sys/bus/virtio/devices/*/features has them (one
#                                      '0'/'1' per bit, bit 0 first: bit 34 is
#                                      VIRTIO_F_RING_PACKED)
#   E2E-STEP-BEGIN NAME                a step starts; its output follows
#   E2E-STEP NAME rc=N                 the step ended with exit status N
#   E2E-ASK QUESTION                   the guest waits for one line on the console
#   E2E-ANSWER WORDS                   what it read
#   E2E-SCRIPT NAME rc=N               the script ended
#   E2E-DONE action=A uptime=U         init is about to poweroff -f / reboot -f / wait
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
export HOME=/root

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t tmpfs tmpfs /tmp

E2E_TAG=myfs
E2E_SCRIPT=
E2E_MOUNT=1
E2E_ASKTIMEOUT=60
for w in $(cat /proc/cmdline); do
	case $w in
	e2e.*=*)
		k=${w%%=*}
		k=${k#e2e.}
		case $k in *[!a-z0-9_]* | '') continue ;; esac
		k=$(echo "$k" | tr a-z A-Z)
		export "E2E_$k=${w#*=}"
		;;
	esac
done
export E2E_TAG E2E_SCRIPT E2E_MOUNT E2E_ASKTIMEOUT

uptime_s() { cut -d' ' -f1 /proc/uptime; }

# step NAME CMD...: runs CMD between markers; returns its status.
step() {
	_name=$1
	shift
	echo "E2E-STEP-BEGIN $_name"
	"$@"
	_rc=$?
	echo "E2E-STEP $_name rc=$_rc"
	return $_rc
}

# e2e_ask QUESTION: prints the question and reads one line from the console
# (the host writes it to QEMU's stdin); prints the answer ("" on timeout).
e2e_ask() {
	echo "E2E-ASK $1" >/dev/console
	_ans=
	read -t "$E2E_ASKTIMEOUT" -r _ans </dev/console
	echo "E2E-ANSWER $_ans" >/dev/console
	echo "$_ans"
}

# e2e_final ACTION: what init does after the script: poweroff (default), reboot, wait.
e2e_final() { echo "$1" >/tmp/e2e-final; }

echo "E2E-BOOT kernel=$(uname -r) uptime=$(uptime_s)"
stty -echo </dev/console 2>/dev/null

if [ -s /e2e/modules.list ]; then
	step modules sh -c 'for m in $(cat /e2e/modules.list); do insmod /lib/modules/e2e/$m.ko || exit 1; done'
fi

for _d in /sys/bus/virtio/devices/*; do
	[ -r "$_d/features" ] || continue
	echo "E2E-VIRTIO dev=${_d##*/} device=$(cat "$_d/device") features=$(cat "$_d/features")"
done

if [ "$E2E_MOUNT" = 1 ]; then
	step mount mount -t virtiofs "$E2E_TAG" /mnt && echo "E2E-MOUNTED tag=$E2E_TAG uptime=$(uptime_s)"
fi

if [ -n "$E2E_SCRIPT" ]; then
	if [ -f "/e2e/scripts/$E2E_SCRIPT.sh" ]; then
		(. "/e2e/scripts/$E2E_SCRIPT.sh")
		echo "E2E-SCRIPT $E2E_SCRIPT rc=$?"
	else
		echo "E2E-SCRIPT $E2E_SCRIPT rc=127 (no such script)"
	fi
fi

action=$(cat /tmp/e2e-final 2>/dev/null)
[ -n "$action" ] || action=poweroff
if [ "$action" != wait ] && grep -q ' /mnt ' /proc/mounts; then
	step umount umount /mnt
fi
echo "E2E-DONE action=$action uptime=$(uptime_s)"
case $action in
reboot) reboot -f ;;
wait) while :; do sleep 3600; done ;;
*) poweroff -f ;;
esac
# Not reached; PID 1 must never exit.
while :; do sleep 3600; done
