#!/bin/bash
# Builds the guest kernels and initramfs images for the end-to-end tests.
#
# Usage (as root, on Debian 12 after `apt-get update`):
#   test/e2e/guest.sh            # build/refresh everything, print what was built
#
# Environment:
#   GUEST_CACHE    cache directory (default: $REPO/.cache/guest)
#   GUEST_KERNELS  kernel series to prepare (default: "6.1 6.12 7")
#   GUEST_OFFLINE  1: do not query apt; use what the cache already holds
#   PEERS_CACHE    test/peers.sh's cache (default: $REPO/.cache/peers): its
#                  private apt state (test/apt-private.sh) serves series 7
#
# 6.1 and 6.12 come from the system's apt (bookworm, bookworm-backports).
# Series 7 (Linux 7.x, DESIGN.md §12) is only in Debian sid, which the system
# does not know: it is resolved and downloaded with the private apt state of
# test/peers.sh (lists fetched here if that state has none for sid). Its
# linux-image-7.*-cloud-amd64 is a meta package; the kernel is in
# linux-binary-V (usr/lib/modules/V/vmlinuz), modules.order and
# modules.builtin in linux-base-V (everything virtio-fs needs is built in).
#
# For each kernel it prints one line
#   KERNEL <uname -r> <path of vmlinuz> <path of initrd>
# and writes the same lines to $GUEST_CACHE/kernels.txt. Idempotent: a second run
# only re-packs an initramfs when one of its inputs changed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${GUEST_CACHE:-$REPO/.cache/guest}
SERIES=${GUEST_KERNELS:-"6.1 6.12 7"}
PEERS=${PEERS_CACHE:-$REPO/.cache/peers}
OFFLINE=${GUEST_OFFLINE:-0}

# Modules the 6.1 cloud kernel needs for virtio-fs, in load order. Modules the
# kernel has built in (all of them on 6.12) are skipped.
MODULES="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci fuse virtiofs"

log() { echo "guest.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (dpkg-deb, mknod, chroot)"

# --- host tools --------------------------------------------------------------
need_pkgs=()
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need_pkgs+=(busybox-static)
command -v cpio >/dev/null || need_pkgs+=(cpio)
command -v fio >/dev/null || need_pkgs+=(fio)
command -v xz >/dev/null || need_pkgs+=(xz-utils)
command -v zstd >/dev/null || need_pkgs+=(zstd)
command -v gcc >/dev/null || need_pkgs+=(gcc)
[[ -f /usr/lib/x86_64-linux-gnu/libc.a ]] || need_pkgs+=(libc6-dev)
if ((${#need_pkgs[@]})); then
	[[ $OFFLINE == 1 ]] && die "missing packages: ${need_pkgs[*]}"
	log "installing ${need_pkgs[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends "${need_pkgs[@]}" >&2
fi
BUSYBOX=/bin/busybox
FIO=$(command -v fio)
if ldd "$BUSYBOX" >/dev/null 2>&1; then
	die "$BUSYBOX is not the static busybox (install busybox-static)"
fi

mkdir -p "$CACHE/debs" "$CACHE/kernels" "$CACHE/build" "$CACHE/initrd"

# --- kernel package selection --------------------------------------------------
# Newest package whose name matches the regex and that has an apt candidate.
PKGNAMES=
newest_pkg() {
	local re=$1 p cand
	[[ -n $PKGNAMES ]] || PKGNAMES=$(apt-cache pkgnames linux-image- 2>/dev/null || true)
	for p in $(grep -E "$re" <<<"$PKGNAMES" | sort -V -r || true); do
		cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
		if [[ -n $cand && $cand != "(none)" ]]; then
			echo "$p $cand"
			return 0
		fi
	done
	return 1
}

# Prints "<package> <version>" for a series ("6.1" or "6.12"); the signed image
# is preferred (its vmlinuz boots with -kernel like the unsigned one).
select_pkg() {
	local series=$1 base
	case $series in
	6.1) base='^linux-image-6\.1\.0-[0-9]+-cloud-amd64' ;;
	6.12) base='^linux-image-6\.12\.[0-9]+(\+[a-z0-9]+)?-cloud-amd64' ;;
	*) die "unknown kernel series $series (want 6.1 or 6.12)" ;;
	esac
	newest_pkg "${base}\$" || newest_pkg "${base}-unsigned\$"
}

# --- series 7: sid through the private apt state ---------------------------------
# shellcheck source=../apt-private.sh
. "$REPO/test/apt-private.sh"
SID_READY=0
# Run in this shell (not in a command substitution) before select_pkg7.
sid_apt() {
	((SID_READY)) && return 0
	if [[ -f $PEERS/apt/parts/peers.sources ]]; then
		APT_PRIVATE_DIR=$PEERS/apt
	else
		apt_private_init "$PEERS/apt" sid || return 1
	fi
	if ! apt_private_has_lists sid; then
		log "no sid lists in $PEERS/apt: apt-get update (private state)"
		grep -qw sid "$PEERS/apt/parts/peers.sources" || apt_private_init "$PEERS/apt" sid || return 1
		apt_private_update || return 1
	fi
	SID_READY=1
}

# Prints "<linux-binary package> <version> <linux-base package>" for the newest
# linux-image-7.*-cloud-amd64 of sid.
select_pkg7() {
	local p v
	sid_apt || return 1
	p=$(apt_cache_private pkgnames linux-image-7. 2>/dev/null | grep -E '^linux-image-7\.[0-9]+\.[0-9]+\+[a-z0-9]+-cloud-amd64$' | sort -V | tail -n1)
	[[ -n $p ]] || return 1
	p=linux-binary-${p#linux-image-}
	v=$(apt_cache_private policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
	[[ -n $v && $v != "(none)" ]] || return 1
	echo "$p $v linux-base-${p#linux-binary-}"
}

# Downloads and extracts linux-binary-V and linux-base-V (same version) into
# one root; prints it.
fetch_pkg7() {
	local pkg=$1 ver=$2 base=$3 root=$CACHE/kernels/$1 deb debs=() p
	if [[ -f $root/.extracted && $(cat "$root/.extracted") == "$ver" ]]; then
		echo "$root"
		return 0
	fi
	for p in "$pkg" "$base"; do
		deb=$(ls "$CACHE/debs/${p}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
		if [[ -z $deb ]]; then
			log "downloading $p=$ver (sid, private apt state)"
			(cd "$CACHE/debs" && apt_private download "$p=$ver" >&2) || die "apt-get download $p=$ver failed"
			deb=$(ls "$CACHE/debs/${p}_${ver//:/%3a}_"*.deb | head -n1)
		fi
		debs+=("$deb")
	done
	rm -rf "$root"
	mkdir -p "$root"
	for deb in "${debs[@]}"; do
		log "extracting $(basename "$deb")"
		dpkg-deb -x "$deb" "$root"
	done
	echo "$ver" >"$root/.extracted"
	echo "$root"
}

# Downloads and extracts a package; prints the extraction root.
fetch_pkg() {
	local pkg=$1 ver=$2 root=$CACHE/kernels/$1 deb
	if [[ -f $root/.extracted && $(cat "$root/.extracted") == "$ver" ]]; then
		echo "$root"
		return 0
	fi
	deb=$(ls "$CACHE/debs/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
	if [[ -z $deb ]]; then
		log "downloading $pkg=$ver"
		(cd "$CACHE/debs" && apt-get download "$pkg=$ver" >&2 2>/dev/null) ||
			(cd "$CACHE/debs" && apt-get download "$pkg=$ver" >&2) || die "apt-get download $pkg=$ver failed"
		deb=$(ls "$CACHE/debs/${pkg}_${ver//:/%3a}_"*.deb | head -n1)
	fi
	log "extracting $(basename "$deb")"
	rm -rf "$root"
	mkdir -p "$root"
	dpkg-deb -x "$deb" "$root"
	echo "$ver" >"$root/.extracted"
	echo "$root"
}

# Offline fallback: newest already-extracted package of a series.
cached_pkg_root() {
	local series=$1 d
	local pat="$CACHE/kernels/linux-image-$series[.-]*-cloud-amd64*"
	[[ $series == 7 ]] && pat="$CACHE/kernels/linux-binary-7.*-cloud-amd64"
	for d in $(ls -d $pat 2>/dev/null | sort -V -r); do
		[[ -f $d/.extracted ]] && { echo "$d"; return 0; }
	done
	return 1
}

# --- initramfs ---------------------------------------------------------------
# copy_with_libs FILE STAGE: copies an ELF program and every library ldd lists
# (plus the loader) into STAGE, at the same paths, with /lib* folded into /usr.
stage_path() {
	case $1 in
	/lib/* | /lib64/* | /bin/* | /sbin/*) echo "/usr$1" ;;
	*) echo "$1" ;;
	esac
}
copy_file() {
	local src=$1 stage=$2 dst
	dst=$stage$(stage_path "$src")
	mkdir -p "$(dirname "$dst")"
	cp -L "$src" "$dst"
}
copy_with_libs() {
	local prog=$1 stage=$2 lib
	copy_file "$prog" "$stage"
	for lib in $(ldd "$prog" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
		copy_file "$lib" "$stage"
	done
}

build_initrd() {
	local kver=$1 root=$2 out=$3 stage=$CACHE/build/$kver.$$ m f dep
	rm -rf "$stage"
	mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,usr/lib/modules/e2e,usr/lib64,proc,sys,dev,mnt,tmp,run,etc,root,e2e/scripts}
	ln -s usr/lib "$stage/lib"
	ln -s usr/lib64 "$stage/lib64"

	# busybox and its applets
	cp "$BUSYBOX" "$stage/bin/busybox"
	for f in $("$BUSYBOX" --list-full); do
		[[ -e $stage/$f || -L $stage/$f ]] || ln -s /bin/busybox "$stage/$f"
	done

	# fio with its shared libraries and the loader
	copy_with_libs "$FIO" "$stage"
	[[ -f /etc/ld.so.cache ]] && cp /etc/ld.so.cache "$stage/etc/"
	echo 'root:x:0:0:root:/root:/bin/sh' >"$stage/etc/passwd"
	echo 'root:x:0:' >"$stage/etc/group"
	chroot "$stage" /usr/bin/fio --version >/dev/null || die "fio does not run inside the initramfs tree"

	# modules (those not built in), decompressed, in load order
	local mdir=$root/lib/modules/$kver
	[[ -d $mdir ]] || mdir=$root/usr/lib/modules/$kver
	: >"$stage/e2e/modules.list"
	for m in $MODULES; do
		# modules.dep is made by depmod at install time; the package ships modules.order.
		dep=$(grep -E "(^|/)${m}\.ko(\.xz|\.zst|\.gz)?\$" "$mdir/modules.order" | head -n1 || true)
		if [[ -z $dep ]]; then
			grep -qE "(^|/)${m}\.ko$" "$mdir/modules.builtin" || die "$kver: module $m is neither a module nor built in"
			continue
		fi
		case $dep in
		*.xz) xz -dc "$mdir/$dep" >"$stage/usr/lib/modules/e2e/$m.ko" ;;
		*.zst) zstd -qdc "$mdir/$dep" >"$stage/usr/lib/modules/e2e/$m.ko" ;;
		*.gz) gzip -dc "$mdir/$dep" >"$stage/usr/lib/modules/e2e/$m.ko" ;;
		*) cp "$mdir/$dep" "$stage/usr/lib/modules/e2e/$m.ko" ;;
		esac
		echo "$m" >>"$stage/e2e/modules.list"
	done

	# guest tools: static helpers for the calls busybox lacks
	gcc -static -O2 -Wall -o "$stage/usr/bin/fsops" "$HERE/guest-tools/fsops.c" || die "cannot build guest-tools/fsops.c"

	# init and the guest scripts
	install -m 0755 "$HERE/guest-init.sh" "$stage/init"
	for f in "$HERE"/guest-scripts/*.sh; do
		install -m 0755 "$f" "$stage/e2e/scripts/"
	done
	mknod -m 0600 "$stage/dev/console" c 5 1
	mknod -m 0666 "$stage/dev/null" c 1 3

	# Uncompressed: under TCG the guest unpacks plain cpio much faster than it
	# decompresses (the image is ~85 MiB, mostly fio's libraries).
	(cd "$stage" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
		cpio --null -o -H newc --quiet --owner=0:0) >"$out.tmp.$$"
	mv "$out.tmp.$$" "$out"
	rm -rf "$stage"
}

inputs_hash() {
	local kver=$1 vmlinuz=$2
	{
		echo "$kver"
		sha256sum "$vmlinuz" "$BUSYBOX" "$FIO" "$HERE/guest.sh" "$HERE/guest-init.sh" "$HERE"/guest-scripts/*.sh "$HERE"/guest-tools/*.c
		gcc --version | head -n1
		ldd "$FIO" | sed 's/ (0x[0-9a-f]*)//'
	} | sha256sum | cut -d' ' -f1
}

# --- main --------------------------------------------------------------------
manifest=()
for series in $SERIES; do
	[[ $series == 6.1 || $series == 6.12 || $series == 7 ]] || die "unknown kernel series $series (GUEST_KERNELS: 6.1, 6.12 and/or 7)"
	root=""
	if [[ $series == 7 && $OFFLINE != 1 ]] && sid_apt && sel=$(select_pkg7); then
		read -r pkg ver base <<<"$sel"
		# sid moves fast: lists older than the mirror may name debs it no
		# longer has. Then the lists are fetched again, once.
		if ! root=$(fetch_pkg7 "$pkg" "$ver" "$base"); then
			log "linux 7: $pkg=$ver not downloadable; apt-get update (private state) and again"
			apt_private_update || die "apt-get update (private state) failed"
			sel=$(select_pkg7) || die "no linux-image-7.*-cloud-amd64 in sid"
			read -r pkg ver base <<<"$sel"
			root=$(fetch_pkg7 "$pkg" "$ver" "$base")
		fi
	elif [[ $series != 7 && $OFFLINE != 1 ]] && sel=$(select_pkg "$series"); then
		read -r pkg ver <<<"$sel"
		root=$(fetch_pkg "$pkg" "$ver")
	elif root=$(cached_pkg_root "$series"); then
		[[ $OFFLINE == 1 ]] || log "linux $series: apt has no candidate (no apt lists?), using the cached package"
		log "linux $series: using cached $(basename "$root")"
	else
		if [[ $series == 6.1 ]]; then
			die "no linux-image-6.1.0-*-cloud-amd64 package found (run apt-get update)"
		fi
		log "linux $series: no package available, skipped"
		continue
	fi
	if [[ $series == 7 ]]; then
		vmlinuz=$(ls "$root"/usr/lib/modules/*/vmlinuz | sort -V | tail -n1)
		kver=$(basename "$(dirname "$vmlinuz")")
	else
		vmlinuz=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -n1)
		kver=${vmlinuz##*/vmlinuz-}
	fi
	hash=$(inputs_hash "$kver" "$vmlinuz")
	# Named by its inputs: work trees sharing one cache (each with its own
	# guest scripts) neither rebuild each other's image nor replace it
	# under a running test. Images unused for a day are removed.
	initrd=$CACHE/initrd/initrd-$kver-${hash:0:16}.cpio
	if [[ ! -f $initrd ]]; then
		log "building $initrd"
		build_initrd "$kver" "$root" "$initrd"
	fi
	touch "$initrd"
	find "$CACHE/initrd" -maxdepth 1 -name "initrd-$kver-*.cpio" -mmin +1440 -delete 2>/dev/null || true
	manifest+=("KERNEL $kver $vmlinuz $initrd")
done

((${#manifest[@]})) || die "no kernel prepared"
printf '%s\n' "${manifest[@]}" >"$CACHE/kernels.txt.tmp.$$"
mv "$CACHE/kernels.txt.tmp.$$" "$CACHE/kernels.txt"
printf '%s\n' "${manifest[@]}"
