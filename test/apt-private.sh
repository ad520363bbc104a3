# Sourced by test/peers.sh and test/e2e/guest.sh: apt with a private state
# (DESIGN.md §9, §12) under one folder, so that packages of other Debian
# suites (trixie, bookworm-backports, sid) can be resolved and downloaded
# without touching the system's apt sources, preferences, lists or dpkg
# status. Nothing is installed: callers unpack with dpkg-deb -x.
#
#   apt_private_init DIR SUITE...   write DIR/parts/peers.sources (the
#                                   system's bookworm mirror and keyring
#                                   with the given suites)
#   apt_private ARGS...             apt-get with the private state
#   apt_cache_private ARGS...       apt-cache with the private state
#   apt_private_update              apt-get update, under a lock on DIR
#   apt_private_has_lists SUITE     true when DIR has SUITE's Packages list
#
# The dpkg status is empty (/dev/null): a resolution (-s install) lists a
# package's whole closure, libc6 included.

APT_PRIVATE_DIR=""

apt_private_init() {
	local dir=$1 uri="" keyring="" f
	shift
	APT_PRIVATE_DIR=$dir
	mkdir -p "$dir/parts" "$dir/prefs" "$dir/lists/partial" "$dir/cache/archives/partial"
	# The mirror and keyring of the system's own Debian stanza (the one whose
	# suites include plain "bookworm"), from deb822 sources, else sources.list.
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
	[[ -n $uri ]] || { echo "apt-private.sh: no Debian bookworm mirror found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list" >&2; return 1; }
	[[ -n $keyring ]] || keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	APT_PRIVATE_URI=$uri
	cat >"$dir/parts/peers.sources.tmp.$$" <<EOF
Types: deb
URIs: $uri
Suites: $*
Components: main
Signed-By: $keyring
EOF
	mv "$dir/parts/peers.sources.tmp.$$" "$dir/parts/peers.sources"
}

apt_private_opts() {
	local d=$APT_PRIVATE_DIR
	printf '%s\n' -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache" \
		-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$d/parts" \
		-o "Dir::Etc::PreferencesParts=$d/prefs" -o Dir::Etc::Preferences=/dev/null \
		-o Dir::State::status=/dev/null
}

apt_private() {
	[[ -n $APT_PRIVATE_DIR ]] || { echo "apt-private.sh: apt_private_init first" >&2; return 1; }
	local opts
	mapfile -t opts < <(apt_private_opts)
	apt-get -q "${opts[@]}" -o APT::Sandbox::User=root "$@"
}

apt_cache_private() {
	[[ -n $APT_PRIVATE_DIR ]] || { echo "apt-private.sh: apt_private_init first" >&2; return 1; }
	local opts
	mapfile -t opts < <(apt_private_opts)
	apt-cache "${opts[@]}" "$@"
}

apt_private_update() {
	(
		flock 8
		apt_private update >"$APT_PRIVATE_DIR/update.log" 2>&1
	) 8>"$APT_PRIVATE_DIR/.update.lock" || { cat "$APT_PRIVATE_DIR/update.log" >&2; return 1; }
}

apt_private_has_lists() {
	compgen -G "$APT_PRIVATE_DIR/lists/*_dists_$1_main_binary-amd64_Packages*" >/dev/null
}
