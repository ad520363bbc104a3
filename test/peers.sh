#!/bin/bash
# Fetches the peers the tests run against besides Debian 12's QEMU 7.2:
# QEMU 10.x (bookworm-backports), the Rust virtiofsd 1.13.x (trixie) and
# 1.14.x (sid), into the project's cache, without touching the system
# (DESIGN.md §9).
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
# status), and the packages are only unpacked (dpkg-deb -x) into
# $PEERS_CACHE/root (sid's virtiofsd into $PEERS_CACHE/root/rust-1.14: it
# runs with trixie's libraries, which meet its needs, glibc >= 2.39).
#
# It leaves two wrappers the tests use:
#   $PEERS_CACHE/bin/qemu-system-x86_64-10   QEMU 10 in a private mount
#       namespace whose /usr/lib/x86_64-linux-gnu/qemu is QEMU 10's module
#       folder (QEMU 10 aborts loading 7.2's modules, and falls back to that
#       path whatever QEMU_MODULE_DIR says), with QEMU 10's firmware first
#       (-L). It uses the system's shared libraries: QEMU 7.2 must be
#       installed (make deps).
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
SCRIPT_SUM=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)

if [[ $REFRESH != 1 && -f $STAMP && -x $QEMU10 && -x $RUSTD && -x $RUSTD14 && -d $ROOT ]] &&
	[[ $(sed -n 's/^script //p' "$STAMP") == "$SCRIPT_SUM" ]]; then
	sed -n 's/^version /peers.sh: /p' "$STAMP" >&2
	exit 0
fi

# --- private apt state ---------------------------------------------------------
APT=$CACHE/apt
mkdir -p "$APT/parts" "$APT/prefs" "$APT/lists/partial" "$APT/cache/archives/partial" "$CACHE/debs"
# The mirror and keyring of the system's own Debian stanza (the one whose
# suites include plain "bookworm"), from deb822 sources, else sources.list.
uri="" keyring=""
for f in /etc/apt/sources.list.d/*.sources; do
	[[ -f $f ]] || continue
	read -r uri keyring < <(awk '
		function flush() { if (ok && uri != "") { print uri, key; found = 1; exit } ok = 0; uri = ""; key = "" }
		/^[[:space:]]*$/ { flush(); next }
		/^URIs:/ { uri = $2 }
		/^Signed-By:/ { key = $2 }
		/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
		END { if (!found) flush() }' "$f") || true
	[[ -n $uri ]] && break
done
if [[ -z $uri && -f /etc/apt/sources.list ]]; then
	uri=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list)
fi
[[ -n $uri ]] || die "no Debian bookworm mirror found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
[[ -n $keyring ]] || keyring=/usr/share/keyrings/debian-archive-keyring.gpg
cat >"$APT/parts/peers.sources" <<EOF
Types: deb
URIs: $uri
Suites: $RUST_SUITE $QEMU_SUITE $RUST14_SUITE
Components: main
Signed-By: $keyring
EOF

apt_private() {
	apt-get -q -o Dir::State::Lists="$APT/lists" -o Dir::Cache="$APT/cache" \
		-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$APT/parts" \
		-o Dir::Etc::PreferencesParts="$APT/prefs" -o Dir::Etc::Preferences=/dev/null \
		-o Dir::State::status=/dev/null -o APT::Sandbox::User=root "$@"
}

start=$(date +%s%N)
log "apt-get update (private state in $APT: $uri $RUST_SUITE $QEMU_SUITE $RUST14_SUITE)"
apt_private update >"$APT/update.log" 2>&1 || { cat "$APT/update.log" >&2; die "apt-get update failed"; }

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
chmod 0755 "$QEMU10.tmp" "$RUSTD.tmp" "$RUSTD14.tmp"
mv "$QEMU10.tmp" "$QEMU10"
mv "$RUSTD.tmp" "$RUSTD"
mv "$RUSTD14.tmp" "$RUSTD14"

qv=$("$QEMU10" --version | head -n1) || die "$QEMU10 --version failed"
rv=$("$RUSTD" --version | head -n1) || die "$RUSTD --version failed"
[[ $qv =~ version\ 10\. ]] || die "$QEMU10 --version: $qv"
r14=$("$RUSTD14" --version | head -n1) || die "$RUSTD14 --version failed"
[[ $rv =~ 1\.13\. ]] || die "$RUSTD --version: $rv"
[[ $r14 =~ 1\.14\. ]] || die "$RUSTD14 --version: $r14"

{
	printf 'package %s\n' "${versions[@]}"
	echo "version $qv ($QEMU10)"
	echo "version $rv ($RUSTD)"
	echo "version $r14 ($RUSTD14)"
	echo "script $SCRIPT_SUM"
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "$qv ($QEMU10)"
log "$rv ($RUSTD)"
log "$r14 ($RUSTD14)"
ms=$((($(date +%s%N) - start) / 1000000))
log "fetched in $((ms / 1000)).$((ms % 1000 / 100))s"
