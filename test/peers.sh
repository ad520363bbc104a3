#!/bin/bash
# Fetches the peers the tests run against besides Debian 12's QEMU 7.2:
# QEMU 10.x (bookworm-backports), QEMU 11.x (sid), the Rust virtiofsd 1.13.x
# (trixie) and 1.14.x (sid), into the project's cache, without touching the
# system (DESIGN.md §9, §12).
#
# Usage (as root; `make test-deps` runs it):
#   test/peers.sh           fetch once, then only check the stamp (no network)
#   PEERS_REFRESH=1 test/peers.sh   ask the mirror again (newer point releases)
#
# Environment:
#   PEERS_CACHE    cache directory (default: $REPO/.cache/peers)
#   PEERS_REFRESH  1: run apt-get update and download again even when stamped
#
# The system's apt sources, preferences, lists and installed packages are
# never touched: apt runs with a private state under $PEERS_CACHE/apt (a
# sources file naming the mirror the system already uses, with the suites
# trixie, bookworm-backports and sid, its own lists and cache, no dpkg
# status; test/apt-private.sh, which test/e2e/guest.sh also uses for sid's
# Linux 7.x), and the packages are only unpacked (dpkg-deb -x) into
# $PEERS_CACHE/root (sid's virtiofsd into $PEERS_CACHE/root/rust-1.14: it
# runs with trixie's libraries, which meet its needs, glibc >= 2.39).
# QEMU 11 needs sid's libraries: apt resolves the whole closure of
# qemu-system-x86/sid against an empty dpkg status (libc6 and its loader
# included, ~70 packages) and it is unpacked apart, into
# $PEERS_CACHE/root-11.
#
# It leaves two wrappers the tests use:
#   $PEERS_CACHE/bin/qemu-system-x86_64-10   QEMU 10 in a private mount
#       namespace whose /usr/lib/x86_64-linux-gnu/qemu is QEMU 10's module
#       folder (QEMU 10 aborts loading 7.2's modules, and falls back to that
#       path whatever QEMU_MODULE_DIR says), with QEMU 10's firmware first
#       (-L). It uses the system's shared libraries: QEMU 7.2 must be
#       installed (make deps).
#   $PEERS_CACHE/bin/qemu-system-x86_64-11   QEMU 11 run by sid's loader
#       with sid's libraries (--library-path), in a private mount namespace
#       whose /usr/lib/x86_64-linux-gnu/qemu is QEMU 11's module folder, with
#       sid's firmware (-L). Of the system it needs only unshare, mount
#       and the folder /usr/lib/x86_64-linux-gnu/qemu to mount over.
#   $PEERS_CACHE/bin/virtiofsd-rust          the Rust virtiofsd 1.13 through
#       trixie's loader and libraries (it needs glibc >= 2.39)
#   $PEERS_CACHE/bin/virtiofsd-rust-1.14     the Rust virtiofsd 1.14 (sid)
#       through the same loader and libraries
# and $PEERS_CACHE/stamp: the package versions, then the --version lines.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${PEERS_CACHE:-$REPO/.cache/peers}
REFRESH=${PEERS_REFRESH:-0}

# PACKAGE/SUITE, and the version each must have (an extended regexp on the
# Debian version).
QEMU_PKGS="qemu-system-x86 qemu-system-common qemu-system-data qemu-system-gui qemu-system-modules-spice"
QEMU_SUITE=bookworm-backports
QEMU_VERSION_RE='^1:10\.'
RUST_PKGS="virtiofsd"
RUST_LIBS="libc6 libcap-ng0 libgcc-s1 libseccomp2"
RUST_SUITE=trixie
RUST_VERSION_RE='^1\.13\.'
RUST14_SUITE=sid
RUST14_VERSION_RE='^1\.14\.'
QEMU11_PKG=qemu-system-x86
QEMU11_SUITE=sid
QEMU11_VERSION_RE='^1:11\.'

log() { echo "peers.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (unshare -m and mount in the QEMU wrapper)"
command -v qemu-system-x86_64 >/dev/null && [[ -d /usr/lib/x86_64-linux-gnu/qemu ]] ||
	die "the system's QEMU 7.2 is not installed (make deps): QEMU 10 uses its shared libraries and module folder"

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

STAMP=$CACHE/stamp
ROOT=$CACHE/root
BIN=$CACHE/bin
QEMU10=$BIN/qemu-system-x86_64-10
RUSTD=$BIN/virtiofsd-rust
RUSTD14=$BIN/virtiofsd-rust-1.14
QEMU11=$BIN/qemu-system-x86_64-11
ROOT11=$CACHE/root-11
SCRIPT_SUM=$(cat "${BASH_SOURCE[0]}" "$HERE/apt-private.sh" | sha256sum | cut -d' ' -f1)

if [[ $REFRESH != 1 && -f $STAMP && -x $QEMU10 && -x $QEMU11 && -x $RUSTD && -x $RUSTD14 && -d $ROOT && -d $ROOT11 ]] &&
	[[ $(sed -n 's/^script //p' "$STAMP") == "$SCRIPT_SUM" ]]; then
	sed -n 's/^version /peers.sh: /p' "$STAMP" >&2
	exit 0
fi

# --- private apt state ---------------------------------------------------------
APT=$CACHE/apt
mkdir -p "$CACHE/debs" "$CACHE/debs-11"
# shellcheck source=apt-private.sh
. "$HERE/apt-private.sh"
apt_private_init "$APT" $RUST_SUITE $QEMU_SUITE $RUST14_SUITE || die "no private apt state"
uri=$APT_PRIVATE_URI

start=$(date +%s%N)
log "apt-get update (private state in $APT: $uri $RUST_SUITE $QEMU_SUITE $RUST14_SUITE)"
apt_private_update || die "apt-get update failed"

wanted=()
for p in $QEMU_PKGS; do wanted+=("$p/$QEMU_SUITE"); done
for p in $RUST_PKGS $RUST_LIBS; do wanted+=("$p/$RUST_SUITE"); done
# sid's virtiofsd has the name of trixie's: it is told apart by its version
# and unpacked apart.
wanted+=("virtiofsd/$RUST14_SUITE")

# --print-uris: 'URI' FILE SIZE HASH per package; download only what the
# debs folder lacks.
uris=$(apt_private download --print-uris "${wanted[@]}" 2>"$APT/download.log") ||
	{ cat "$APT/download.log" >&2; die "apt-get download --print-uris failed"; }
debs=()
missing=()
while read -r u file _; do
	[[ -n $file ]] || continue
	debs+=("$CACHE/debs/$file")
	[[ -f $CACHE/debs/$file ]] || missing+=("$u")
done <<<"$uris"
((${#debs[@]} == ${#wanted[@]})) || die "apt offers ${#debs[@]} of ${#wanted[@]} packages:
$uris"
if ((${#missing[@]})); then
	log "downloading ${#missing[@]} package(s)"
	(cd "$CACHE/debs" && apt_private download "${wanted[@]}" >"$APT/download.log" 2>&1) ||
		{ cat "$APT/download.log" >&2; die "apt-get download failed"; }
fi

# --- versions --------------------------------------------------------------------
versions=()
rust13="" rust14=""
for deb in "${debs[@]}"; do
	[[ -f $deb ]] || die "$deb missing after download"
	pkg=$(dpkg-deb -f "$deb" Package)
	ver=$(dpkg-deb -f "$deb" Version)
	versions+=("$pkg $ver")
	case " $QEMU_PKGS " in *" $pkg "*) [[ $ver =~ $QEMU_VERSION_RE ]] || die "$pkg $ver from $QEMU_SUITE is not QEMU 10.x" ;; esac
	if [[ $pkg == virtiofsd ]]; then
		if [[ $ver =~ $RUST_VERSION_RE ]]; then
			rust13=$deb
		elif [[ $ver =~ $RUST14_VERSION_RE ]]; then
			rust14=$deb
		else
			die "virtiofsd $ver is neither 1.13.x ($RUST_SUITE) nor 1.14.x ($RUST14_SUITE)"
		fi
	fi
done
[[ -n $rust13 && -n $rust14 ]] || die "want virtiofsd 1.13.x from $RUST_SUITE and 1.14.x from $RUST14_SUITE"

# --- unpack ------------------------------------------------------------------------
rm -rf "$ROOT.new"
mkdir -p "$ROOT.new"
for deb in "${debs[@]}"; do
	[[ $deb == "$rust14" ]] || dpkg-deb -x "$deb" "$ROOT.new"
done
mkdir -p "$ROOT.new/rust-1.14"
dpkg-deb -x "$rust14" "$ROOT.new/rust-1.14"
[[ -x $ROOT.new/rust-1.14/usr/libexec/virtiofsd ]] || die "no usr/libexec/virtiofsd in virtiofsd/$RUST14_SUITE"
[[ -x $ROOT.new/usr/bin/qemu-system-x86_64 ]] || die "no usr/bin/qemu-system-x86_64 in the QEMU packages"
[[ -d $ROOT.new/usr/lib/x86_64-linux-gnu/qemu ]] || die "no QEMU module folder in the QEMU packages"
[[ -x $ROOT.new/usr/libexec/virtiofsd ]] || die "no usr/libexec/virtiofsd in the virtiofsd package"
[[ -x $ROOT.new/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 ]] || die "no loader in libc6/$RUST_SUITE"
rm -rf "$ROOT"
mv "$ROOT.new" "$ROOT"

# --- QEMU 11: the closure of qemu-system-x86/sid ----------------------------------
# An empty dpkg status makes apt list every package the closure needs, sid's
# libc6 (and loader) included; recommends (GUI, spice, ...) are left out.
start11=$(date +%s%N)
sim=$(apt_private -s -t "$QEMU11_SUITE" --no-install-recommends install "$QEMU11_PKG/$QEMU11_SUITE" 2>"$APT/resolve-11.log") ||
	{ cat "$APT/resolve-11.log" >&2; die "apt cannot resolve $QEMU11_PKG/$QEMU11_SUITE"; }
wanted11=()
while read -r _ p v _; do
	wanted11+=("$p=${v#(}")
done < <(grep '^Inst ' <<<"$sim")
((${#wanted11[@]} > 10)) || die "the closure of $QEMU11_PKG/$QEMU11_SUITE has ${#wanted11[@]} packages:
$sim"
uris11=$(apt_private download --print-uris "${wanted11[@]}" 2>"$APT/download-11.log") ||
	{ cat "$APT/download-11.log" >&2; die "apt-get download --print-uris (QEMU 11) failed"; }
debs11=()
missing11=()
while read -r u file _; do
	[[ -n $file ]] || continue
	debs11+=("$CACHE/debs-11/$file")
	[[ -f $CACHE/debs-11/$file ]] || missing11+=("$u")
done <<<"$uris11"
((${#debs11[@]} == ${#wanted11[@]})) || die "apt offers ${#debs11[@]} of ${#wanted11[@]} packages of QEMU 11's closure"
if ((${#missing11[@]})); then
	log "downloading ${#missing11[@]} package(s) of QEMU 11's closure"
	(cd "$CACHE/debs-11" && apt_private download "${wanted11[@]}" >"$APT/download-11.log" 2>&1) ||
		{ cat "$APT/download-11.log" >&2; die "apt-get download (QEMU 11) failed"; }
fi
# Debs of older point releases are dropped.
keep11=$(printf '%s\n' "${debs11[@]}")
for f in "$CACHE"/debs-11/*.deb; do
	[[ -f $f ]] && ! grep -qxF "$f" <<<"$keep11" && rm -f "$f"
done
rm -rf "$ROOT11.new"
mkdir -p "$ROOT11.new"
for deb in "${debs11[@]}"; do
	[[ -f $deb ]] || die "$deb missing after download"
	pkg=$(dpkg-deb -f "$deb" Package)
	ver=$(dpkg-deb -f "$deb" Version)
	versions+=("$pkg $ver ($QEMU11_SUITE, QEMU 11)")
	[[ $pkg != "$QEMU11_PKG" ]] || [[ $ver =~ $QEMU11_VERSION_RE ]] || die "$pkg $ver from $QEMU11_SUITE is not QEMU 11.x"
	dpkg-deb -x "$deb" "$ROOT11.new"
done
[[ -x $ROOT11.new/usr/bin/qemu-system-x86_64 ]] || die "no usr/bin/qemu-system-x86_64 in QEMU 11's closure"
[[ -d $ROOT11.new/usr/lib/x86_64-linux-gnu/qemu ]] || die "no QEMU module folder in QEMU 11's closure"
[[ -x $ROOT11.new/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 ]] || die "no loader in QEMU 11's closure"
rm -rf "$ROOT11"
mv "$ROOT11.new" "$ROOT11"
ms11=$((($(date +%s%N) - start11) / 1000000))
log "QEMU 11: ${#debs11[@]} packages, $(du -sm "$CACHE/debs-11" | cut -f1) MB of debs, $(du -sm "$ROOT11" | cut -f1) MB unpacked, $((ms11 / 1000)).$((ms11 % 1000 / 100))s"

# --- wrappers ----------------------------------------------------------------------
mkdir -p "$BIN"
cat >"$QEMU10.tmp" <<EOF
#!/bin/sh
# QEMU 10 from $QEMU_SUITE, unpacked by test/peers.sh (do not edit: it is
# rewritten). A private mount namespace puts QEMU 10's modules where QEMU
# looks for them; the system's QEMU 7.2 keeps its own. QEMU stays this
# process (unshare and sh exec it): signals reach it directly.
X='$ROOT'
exec unshare -m sh -c 'mount --bind "\$0/usr/lib/x86_64-linux-gnu/qemu" /usr/lib/x86_64-linux-gnu/qemu &&
exec "\$0/usr/bin/qemu-system-x86_64" -L "\$0/usr/share/qemu" -L /usr/share/seabios -L /usr/lib/ipxe/qemu "\$@"' "\$X" "\$@"
EOF
cat >"$RUSTD.tmp" <<EOF
#!/bin/sh
# The Rust virtiofsd from $RUST_SUITE, unpacked by test/peers.sh (do not
# edit: it is rewritten), run by $RUST_SUITE's loader with its libraries.
X='$ROOT'
exec "\$X/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "\$X/usr/lib/x86_64-linux-gnu" "\$X/usr/libexec/virtiofsd" "\$@"
EOF
cat >"$RUSTD14.tmp" <<EOF
#!/bin/sh
# The Rust virtiofsd 1.14 from $RUST14_SUITE, unpacked by test/peers.sh (do
# not edit: it is rewritten), run by $RUST_SUITE's loader with its libraries.
X='$ROOT'
exec "\$X/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "\$X/usr/lib/x86_64-linux-gnu" "\$X/rust-1.14/usr/libexec/virtiofsd" "\$@"
EOF
cat >"$QEMU11.tmp" <<EOF
#!/bin/sh
# QEMU 11 from $QEMU11_SUITE, unpacked with its closure by test/peers.sh (do
# not edit: it is rewritten). It runs by $QEMU11_SUITE's loader with
# $QEMU11_SUITE's libraries, in a private mount namespace that puts its
# modules where QEMU looks for them, with its own firmware. QEMU stays this
# process (unshare, sh and the loader exec it): signals reach it directly.
X='$ROOT11'
exec unshare -m sh -c 'mount --bind "\$0/usr/lib/x86_64-linux-gnu/qemu" /usr/lib/x86_64-linux-gnu/qemu &&
exec "\$0/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "\$0/usr/lib/x86_64-linux-gnu" "\$0/usr/bin/qemu-system-x86_64" -L "\$0/usr/share/qemu" -L "\$0/usr/share/seabios" -L "\$0/usr/lib/ipxe/qemu" "\$@"' "\$X" "\$@"
EOF
chmod 0755 "$QEMU10.tmp" "$RUSTD.tmp" "$RUSTD14.tmp" "$QEMU11.tmp"
mv "$QEMU10.tmp" "$QEMU10"
mv "$RUSTD.tmp" "$RUSTD"
mv "$RUSTD14.tmp" "$RUSTD14"
mv "$QEMU11.tmp" "$QEMU11"

qv=$("$QEMU10" --version | head -n1) || die "$QEMU10 --version failed"
rv=$("$RUSTD" --version | head -n1) || die "$RUSTD --version failed"
[[ $qv =~ version\ 10\. ]] || die "$QEMU10 --version: $qv"
r14=$("$RUSTD14" --version | head -n1) || die "$RUSTD14 --version failed"
[[ $rv =~ 1\.13\. ]] || die "$RUSTD --version: $rv"
[[ $r14 =~ 1\.14\. ]] || die "$RUSTD14 --version: $r14"
q11=$("$QEMU11" --version | head -n1) || die "$QEMU11 --version failed"
[[ $q11 =~ version\ 11\. ]] || die "$QEMU11 --version: $q11"

{
	printf 'package %s\n' "${versions[@]}"
	echo "version $qv ($QEMU10)"
	echo "version $rv ($RUSTD)"
	echo "version $r14 ($RUSTD14)"
	echo "version $q11 ($QEMU11)"
	echo "script $SCRIPT_SUM"
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "$qv ($QEMU10)"
log "$rv ($RUSTD)"
log "$r14 ($RUSTD14)"
log "$q11 ($QEMU11)"
ms=$((($(date +%s%N) - start) / 1000000))
log "fetched in $((ms / 1000)).$((ms % 1000 / 100))s"
