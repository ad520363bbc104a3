package main

import (
	"io"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

func TestSplitOptions(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"source=/a", []string{"source=/a"}},
		{"source=/p,,ath,cache=none,xattr", []string{"source=/p,ath", "cache=none", "xattr"}},
		{"a,,,,b", []string{"a,,b"}},
		{"", []string{""}},
		{",", []string{"", ""}},
	} {
		if got := splitOptions(tc.in); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("splitOptions(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// defaults are the Options newCommand starts from.
func defaults() Options {
	return *newCommandOptions()
}

// parse parses args as the command does, and validates the result.
func parse(args []string) (*Options, error) {
	o := newCommandOptions()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	registerFlags(fs, o)
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, errUnexpectedArgs(fs.Args())
	}
	return o, o.validate()
}

type errUnexpectedArgs []string

func (e errUnexpectedArgs) Error() string { return "unexpected arguments " + strings.Join(e, " ") }

// base is the minimum a valid command line needs.
var base = []string{"--shared-dir=/s", "--fd=3"}

func withBase(o *Options) { o.SharedDir, o.FD = "/s", 3 }

// parseCases: every option in each of its spellings, repeats, the two
// dialects mixed, and the launch lines of Kata and libvirt verbatim. want
// edits the defaults (after base) into the expected Options, notes
// included.
var parseCases = []struct {
	name string
	args []string
	base bool // prepend base
	want func(*Options)
}{
	// Where and how to serve.
	{"--shared-dir", []string{"--shared-dir", "/x", "--fd=3"}, false, func(o *Options) { o.SharedDir, o.FD = "/x", 3 }},
	{"-o source", []string{"-o", "source=/y", "--fd", "3"}, false, func(o *Options) { o.SharedDir, o.FD = "/y", 3 }},
	{"--socket-path", []string{"--shared-dir=/s", "--socket-path=/run/v.sock"}, false, func(o *Options) { o.SharedDir, o.SocketPath = "/s", "/run/v.sock" }},
	{"--socket (deprecated)", []string{"--shared-dir=/s", "--socket", "/run/v.sock"}, false, func(o *Options) { o.SharedDir, o.SocketPath = "/s", "/run/v.sock" }},
	{"--socket-group", []string{"--shared-dir=/s", "--socket-path=/v.sock", "--socket-group=kvm"}, false, func(o *Options) {
		o.SharedDir, o.SocketPath, o.SocketGroup = "/s", "/v.sock", "kvm"
	}},
	{"--queues", []string{"--queues=2"}, true, func(o *Options) { o.Queues = 2 }},
	{"--tag", []string{"--tag", "myfs"}, true, func(o *Options) { o.Tag = "myfs" }},
	{"--thread-pool-size", []string{"--thread-pool-size=1"}, true, func(o *Options) { o.ThreadPoolSize = 1 }},
	{"-o thread_pool_size", []string{"-o", "thread_pool_size=0"}, true, func(o *Options) { o.ThreadPoolSize = 0 }},
	{"--rlimit-nofile", []string{"--rlimit-nofile", "4096"}, true, func(o *Options) { o.RlimitNofile = 4096 }},
	{"--inode-fd-budget", []string{"--inode-fd-budget=5000"}, true, func(o *Options) { o.InodeFDBudget = 5000 }},
	{"--rlimit-nofile 0", []string{"--rlimit-nofile=0"}, true, func(o *Options) { o.RlimitNofile = 0 }},
	{"--metrics-addr", []string{"--metrics-addr", "unix:/run/m.sock"}, true, func(o *Options) { o.MetricsAddr = "unix:/run/m.sock" }},
	{"--cache-size", []string{"--cache-size", "64M"}, true, func(o *Options) { o.CacheSize = 64 << 20 }},
	{"--cache-size 0", []string{"--cache-size=64M", "--cache-size=0"}, true, func(o *Options) { o.CacheSize = 0 }},
	{"--inode-dax", []string{"--inode-dax=flag"}, true, func(o *Options) { o.InodeDAX = InodeDAXFlag }},

	// Process and logging.
	{"--log-level", []string{"--log-level", "debug"}, true, func(o *Options) { o.LogLevel = "debug" }},
	{"-o log_level", []string{"-o", "log_level=err"}, true, func(o *Options) { o.LogLevel = "err" }},
	{"-d", []string{"-d"}, true, func(o *Options) { o.LogLevel = "debug" }},
	{"-o debug", []string{"-o", "debug"}, true, func(o *Options) { o.LogLevel = "debug" }},
	{"--syslog", []string{"--syslog"}, true, func(o *Options) { o.Syslog = true }},
	{"-f", []string{"-f"}, true, func(o *Options) { o.Foreground = true }},
	{"--daemonize", []string{"--daemonize"}, true, func(o *Options) { o.Daemonize = true }},
	{"-s", []string{"-s"}, true, func(o *Options) { o.notes = []string{"-s has no effect: see --thread-pool-size"} }},
	{"--print-capabilities", []string{"--print-capabilities"}, false, func(o *Options) { o.PrintCapabilities = true }},
	{"-V", []string{"-V"}, false, func(o *Options) { o.Version = true }},
	{"--version", []string{"--version"}, false, func(o *Options) { o.Version = true }},

	// File system.
	{"--cache", []string{"--cache", "never"}, true, func(o *Options) { o.Cache = "never" }},
	{"--cache=metadata", []string{"--cache=metadata"}, true, func(o *Options) { o.Cache = "metadata" }},
	{"-o cache=none", []string{"-o", "cache=none"}, true, func(o *Options) { o.Cache = "none" }},
	{"-o cache=always", []string{"-o", "cache=always"}, true, func(o *Options) { o.Cache = "always" }},
	{"-o timeout", []string{"-o", "timeout=2.5"}, true, func(o *Options) { o.Timeout = "2.5" }},
	{"--allow-mmap", []string{"--allow-mmap"}, true, func(o *Options) {
		o.notes = []string{"--allow-mmap has no effect: the guest maps shared files through its page cache, or through the DAX window of --cache-size"}
	}},
	{"--writeback", []string{"--writeback"}, true, func(o *Options) { o.Writeback = true }},
	{"-o writeback, no_writeback", []string{"-o", "writeback", "-o", "no_writeback"}, true, func(o *Options) {}},
	{"--xattr", []string{"--xattr"}, true, func(o *Options) { o.Xattr = true }},
	{"-o xattr", []string{"-o", "xattr"}, true, func(o *Options) { o.Xattr = true }},
	{"-o no_xattr after --xattr", []string{"--xattr", "-o", "no_xattr"}, true, func(o *Options) {}},
	{"--xattrmap", []string{"--xattrmap", ":map::user.virtiofs.:"}, true, func(o *Options) { o.XattrMap = ":map::user.virtiofs.:" }},
	{"-o xattrmap with ,,", []string{"-o", "xattrmap=:prefix:all::a,,b:"}, true, func(o *Options) { o.XattrMap = ":prefix:all::a,b:" }},
	// The Rust daemon 1.14's negotiation modes: never by default, the
	// bare flag always; 1.13's boolean words keep their meaning.
	{"--posix-acl", []string{"--posix-acl"}, true, func(o *Options) { o.PosixACL = "always" }},
	{"--posix-acl=auto", []string{"--posix-acl=auto"}, true, func(o *Options) { o.PosixACL = "auto" }},
	{"--posix-acl=always", []string{"--posix-acl=always"}, true, func(o *Options) { o.PosixACL = "always" }},
	{"--posix-acl=never after auto", []string{"--posix-acl=auto", "--posix-acl=never"}, true, func(o *Options) {}},
	{"--posix-acl=true", []string{"--posix-acl=true"}, true, func(o *Options) { o.PosixACL = "always" }},
	{"--posix-acl=false after the bare flag", []string{"--posix-acl", "--posix-acl=false"}, true, func(o *Options) {}},
	{"-o posix_acl", []string{"-o", "posix_acl"}, true, func(o *Options) { o.PosixACL = "always" }},
	{"-o posix_acl=auto", []string{"-o", "posix_acl=auto"}, true, func(o *Options) { o.PosixACL = "auto" }},
	{"-o no_posix_acl", []string{"-o", "posix_acl,no_posix_acl"}, true, func(o *Options) {}},
	{"--security-label", []string{"--security-label"}, true, func(o *Options) { o.SecurityLabel = "always" }},
	{"--security-label=auto", []string{"--security-label=auto"}, true, func(o *Options) { o.SecurityLabel = "auto" }},
	{"--security-label=always", []string{"--security-label=always"}, true, func(o *Options) { o.SecurityLabel = "always" }},
	{"--security-label=never after always", []string{"--security-label=always", "--security-label=never"}, true, func(o *Options) {}},
	{"--security-label=1", []string{"--security-label=1"}, true, func(o *Options) { o.SecurityLabel = "always" }},
	{"-o security_label", []string{"-o", "security_label"}, true, func(o *Options) { o.SecurityLabel = "always" }},
	{"-o no_security_label", []string{"-o", "security_label=auto,no_security_label"}, true, func(o *Options) {}},
	// Translation with ACLs off (never) is what the Rust daemon allows.
	{"--translate-uid with --posix-acl=never", []string{"--posix-acl=never", "--translate-uid=guest:1000:2000:1"}, true, func(o *Options) {
		o.TranslateUID = []string{"guest:1000:2000:1"}
	}},
	{"--inode-file-handles=fallback", []string{"--inode-file-handles=fallback"}, true, func(o *Options) {}},
	// On by default (the Rust daemon 1.13's default).
	{"--announce-submounts", []string{"--announce-submounts"}, true, func(o *Options) {}},
	{"--no-announce-submounts", []string{"--no-announce-submounts"}, true, func(o *Options) { o.AnnounceSubmounts = false }},
	{"--no-announce-submounts last", []string{"--announce-submounts", "--no-announce-submounts"}, true, func(o *Options) { o.AnnounceSubmounts = false }},
	{"--announce-submounts last", []string{"--no-announce-submounts", "--announce-submounts"}, true, func(o *Options) {}},
	{"-o announce_submounts", []string{"-o", "announce_submounts"}, true, func(o *Options) {}},
	{"-o no_announce_submounts", []string{"-o", "no_announce_submounts"}, true, func(o *Options) { o.AnnounceSubmounts = false }},
	{"-o announce_submounts after no", []string{"-o", "no_announce_submounts,announce_submounts"}, true, func(o *Options) {}},
	{"--no-readdirplus", []string{"--no-readdirplus"}, true, func(o *Options) { o.NoReaddirplus = true }},
	{"-o no_readdirplus", []string{"-o", "no_readdirplus"}, true, func(o *Options) { o.NoReaddirplus = true }},
	{"-o readdirplus last", []string{"--no-readdirplus", "-o", "readdirplus"}, true, func(o *Options) {}},
	{"--allow-direct-io", []string{"--allow-direct-io"}, true, func(o *Options) { o.AllowDirectIO = true }},
	{"-o allow_direct_io", []string{"-o", "allow_direct_io"}, true, func(o *Options) { o.AllowDirectIO = true }},
	{"--killpriv-v2", []string{"--killpriv-v2"}, true, func(o *Options) { o.KillprivV2 = true }},
	{"--no-killpriv-v2 last", []string{"--killpriv-v2", "--no-killpriv-v2"}, true, func(o *Options) {}},
	{"-o killpriv_v2", []string{"-o", "killpriv_v2"}, true, func(o *Options) { o.KillprivV2 = true }},
	{"-o no_killpriv_v2", []string{"-o", "killpriv_v2", "-o", "no_killpriv_v2"}, true, func(o *Options) {}},
	{"--inode-file-handles", []string{"--inode-file-handles=prefer"}, true, func(o *Options) { o.InodeFileHandles = "prefer" }},
	{"--inode-file-handles mandatory", []string{"--inode-file-handles", "mandatory"}, true, func(o *Options) { o.InodeFileHandles = "mandatory" }},
	{"-o posix_lock", []string{"-o", "posix_lock"}, true, func(o *Options) { o.PosixLock = true }},
	{"-o no_posix_lock", []string{"-o", "posix_lock", "-o", "no_posix_lock"}, true, func(o *Options) {}},
	{"-o flock", []string{"-o", "flock"}, true, func(o *Options) { o.Flock = true }},
	{"-o no_flock", []string{"-o", "flock,no_flock"}, true, func(o *Options) {}},
	{"--readonly", []string{"--readonly"}, true, func(o *Options) { o.ReadOnly = true }},
	{"--preserve-noatime", []string{"--preserve-noatime"}, true, func(o *Options) { o.PreserveNoatime = true }},
	{"-o allow_root", []string{"-o", "allow_root"}, true, func(o *Options) {
		o.notes = []string{"-o allow_root has no effect: the guest kernel decides who may access the mount"}
	}},
	{"-o max_idle_threads", []string{"-o", "max_idle_threads=10"}, true, func(o *Options) {
		o.notes = []string{"-o max_idle_threads has no effect: workers are goroutines, see --thread-pool-size"}
	}},

	// Id translation accumulates, in order.
	{"--translate-uid/gid", []string{
		"--translate-uid", "map:0:1000:1", "--translate-gid=squash-guest:0:1000:65536",
		"--translate-uid=forbid-guest:1:10", "--translate-gid", "host:1000:0:1",
	}, true, func(o *Options) {
		o.TranslateUID = []string{"map:0:1000:1", "forbid-guest:1:10"}
		o.TranslateGID = []string{"squash-guest:0:1000:65536", "host:1000:0:1"}
	}},
	{"--translate-uid every type", []string{
		"--translate-uid=guest:0:100:1", "--translate-uid=host:100:0:1", "--translate-uid=squash-guest:1:100:9",
		"--translate-uid=squash-host:101:1:9", "--translate-uid=map:20:200:5", "--translate-uid=forbid-guest:10:10",
	}, true, func(o *Options) {
		o.TranslateUID = []string{"guest:0:100:1", "host:100:0:1", "squash-guest:1:100:9",
			"squash-host:101:1:9", "map:20:200:5", "forbid-guest:10:10"}
	}},

	// Migration (find-paths; file-handles and --migration-verify-handles
	// are refused, see TestParseErrors).
	{"--migration-*", []string{
		"--migration-mode=find-paths", "--migration-on-error", "guest-error", "--migration-confirm-paths",
	}, true, func(o *Options) {
		o.MigrationMode, o.MigrationOnError, o.MigrationConfirmPaths = "find-paths", "guest-error", true
	}},
	{"--migration-mode find-paths", []string{"--migration-mode", "find-paths", "--migration-on-error=abort"}, true, func(o *Options) {
		o.MigrationMode, o.MigrationOnError = "find-paths", "abort"
	}},
	{"--migration-verify-handles", []string{"--migration-verify-handles"}, true, func(o *Options) { o.MigrationVerifyHandles = true }},
	{"--migration-mode file-handles", []string{"--migration-mode=file-handles", "--migration-on-error=guest-error"}, true, func(o *Options) {
		o.MigrationMode, o.MigrationOnError = "file-handles", "guest-error"
	}},

	// Sandbox block.
	{"--sandbox", []string{"--sandbox", "chroot"}, true, func(o *Options) { o.Sandbox = "chroot" }},
	{"-o sandbox", []string{"-o", "sandbox=namespace"}, true, func(o *Options) { o.Sandbox = "namespace" }},
	{"--sandbox=none", []string{"--sandbox=none"}, true, func(o *Options) { o.Sandbox = "none" }},
	{"--seccomp", []string{"--seccomp=kill"}, true, func(o *Options) { o.Seccomp = "kill" }},
	{"-o seccomp", []string{"-o", "seccomp=log", "--seccomp", "trap", "-o", "seccomp=none"}, true, func(o *Options) { o.Seccomp = "none" }},
	{"--modcaps", []string{"--modcaps=+sys_admin:-mknod"}, true, func(o *Options) { o.Modcaps = "+sys_admin:-mknod" }},
	{"-o modcaps", []string{"-o", "modcaps=-chown"}, true, func(o *Options) { o.Modcaps = "-chown" }},
	{"--uid-map/--gid-map accumulate", []string{
		"--uid-map=:0:1000:1:", "--uid-map", ":1:100000:65536:", "--gid-map=:0:1000:1:",
	}, true, func(o *Options) {
		o.UIDMaps = []string{":0:1000:1:", ":1:100000:65536:"}
		o.GIDMaps = []string{":0:1000:1:"}
	}},

	// Repeats and dialects.
	{"last wins across dialects", []string{"--shared-dir", "/x", "-o", "source=/y", "--shared-dir=/z", "--fd=3"}, false, func(o *Options) {
		o.SharedDir, o.FD = "/z", 3
	}},
	{"-o repeated accumulates", []string{"-o", "cache=always", "-o", "log_level=debug", "-o", "xattr"}, true, func(o *Options) {
		o.Cache, o.LogLevel, o.Xattr = "always", "debug", true
	}},
	{"single-valued repeated", []string{"--thread-pool-size=1", "--thread-pool-size=4", "--cache=never", "--cache", "auto", "--fd=5"}, true, func(o *Options) {
		o.ThreadPoolSize, o.Cache, o.FD = 4, "auto", 5
	}},
	{"boolean repeated", []string{"--xattr", "--xattr", "--syslog", "--syslog"}, true, func(o *Options) { o.Xattr, o.Syslog = true, true }},
	{"note once", []string{"--allow-mmap", "--allow-mmap", "-o", "allow_root", "-o", "allow_root"}, true, func(o *Options) {
		o.notes = []string{
			"--allow-mmap has no effect: the guest maps shared files through its page cache, or through the DAX window of --cache-size",
			"-o allow_root has no effect: the guest kernel decides who may access the mount",
		}
	}},
	{"empty -o items", []string{"-o", ",xattr,"}, true, func(o *Options) { o.Xattr = true }},

	// Launch lines, verbatim.
	{"Kata current", []string{"--syslog", "--cache=auto", "--shared-dir=/run/kata/shared", "--fd=3", "--thread-pool-size=1", "--announce-submounts", "--xattr"}, false, func(o *Options) {
		o.Syslog, o.Cache, o.SharedDir, o.FD, o.ThreadPoolSize, o.AnnounceSubmounts, o.Xattr = true, "auto", "/run/kata/shared", 3, 1, true, true
	}},
	{"Kata older", []string{"--syslog", "-o", "cache=auto", "-o", "no_posix_lock", "-o", "source=/run/kata/shared", "--fd=3", "-f", "--thread-pool-size=1", "-o", "announce_submounts"}, false, func(o *Options) {
		o.Syslog, o.Cache, o.SharedDir, o.FD, o.Foreground, o.ThreadPoolSize, o.AnnounceSubmounts = true, "auto", "/run/kata/shared", 3, true, 1, true
	}},
	{"Kata with duplicates", []string{"--syslog", "--cache=auto", "--shared-dir=/a", "--fd=3", "--thread-pool-size=1", "--announce-submounts", "--thread-pool-size=2", "--cache=never", "--syslog"}, false, func(o *Options) {
		o.Syslog, o.Cache, o.SharedDir, o.FD, o.ThreadPoolSize, o.AnnounceSubmounts = true, "never", "/a", 3, 2, true
	}},
	{"libvirt -o", []string{"--fd=21", "-o", "source=/var/lib/a,,b,cache=none,sandbox=chroot,xattr"}, false, func(o *Options) {
		o.FD, o.SharedDir, o.Cache, o.Sandbox, o.Xattr = 21, "/var/lib/a,b", "none", "chroot", true
	}},
	{"libvirt separate-options", []string{"--fd=21", "--shared-dir", "/var/lib/a,b", "--cache", "never", "--sandbox", "chroot", "--xattr", "--rlimit-nofile=65536", "--log-level", "debug"}, false, func(o *Options) {
		o.FD, o.SharedDir, o.Cache, o.Sandbox, o.Xattr, o.RlimitNofile, o.LogLevel = 21, "/var/lib/a,b", "never", "chroot", true, 65536, "debug"
	}},
	{"libvirt session mode", []string{"--fd=21", "--shared-dir", "/home/u/s", "--sandbox", "namespace", "--uid-map=:0:1000:1:", "--uid-map=:1:100000:65536:", "--gid-map=:0:1000:1:", "--gid-map=:1:100000:65536:"}, false, func(o *Options) {
		o.FD, o.SharedDir, o.Sandbox = 21, "/home/u/s", "namespace"
		o.UIDMaps = []string{":0:1000:1:", ":1:100000:65536:"}
		o.GIDMaps = []string{":0:1000:1:", ":1:100000:65536:"}
	}},
}

// newCommandOptions returns the Options newCommand binds its flags to.
func newCommandOptions() *Options {
	cmd := newCommand(nil)
	var o *Options
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if fv, ok := f.Value.(*flagValue); ok && o == nil {
			o = fv.o
		}
	})
	return o
}

func TestParse(t *testing.T) {
	for _, tc := range parseCases {
		t.Run(tc.name, func(t *testing.T) {
			args := tc.args
			want := defaults()
			if tc.base {
				args = append(slices.Clone(base), args...)
				withBase(&want)
			}
			tc.want(&want)
			got, err := parse(args)
			if err != nil {
				t.Fatalf("%q: %v", args, err)
			}
			if !reflect.DeepEqual(*got, want) {
				t.Errorf("%q:\n got %+v\nwant %+v", args, *got, want)
			}
		})
	}
}

// TestEveryOptionTested: each spelling in the option table appears in
// TestParse's cases, and the error cases reach each checked value.
func TestEveryOptionTested(t *testing.T) {
	var all []string
	for _, tc := range parseCases {
		all = append(all, tc.args...)
	}
	joined := " " + strings.Join(all, " ") + " "
	for _, opt := range optionTable {
		if opt.long != "" && !strings.Contains(joined, " --"+opt.long+" ") && !strings.Contains(joined, " --"+opt.long+"=") {
			t.Errorf("--%s has no parse case", opt.long)
		}
		if opt.short != "" && !strings.Contains(joined, " -"+opt.short+" ") {
			t.Errorf("-%s has no parse case", opt.short)
		}
		if opt.oKey != "" && !regexpOKey(opt.oKey).MatchString(joined) {
			t.Errorf("-o %s has no parse case", opt.oKey)
		}
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"--bogus"}, "unknown flag: --bogus"},
		{[]string{"-o", "bogus"}, "unknown option -o bogus"},
		{[]string{"-o", "source=/a,nonsense=1"}, "unknown option -o nonsense=1"},
		{[]string{"-o", "no_source"}, "unknown option"},      // no_ only for booleans
		{[]string{"-o", "cache"}, "unknown option -o cache"}, // needs a value
		{[]string{"-o", "xattr=maybe"}, "not a boolean"},
		{[]string{"-x"}, "unknown shorthand flag"},
		{[]string{"positional"}, "unexpected arguments"},
		{[]string{"--cache=sometimes"}, "not one of"},
		{[]string{"-o", "cache=sometimes"}, "not one of"},
		{[]string{"--log-level=loud"}, "not one of"},
		{[]string{"--inode-file-handles=always"}, "not one of"},
		{[]string{"--sandbox=jail"}, "not one of"},
		{[]string{"-o", "sandbox=jail"}, "not one of"},
		{[]string{"--seccomp=allow"}, "not one of"},
		{[]string{"--migration-mode=copy"}, "not one of"},
		{[]string{"--migration-on-error=ignore"}, "not one of"},
		{[]string{"--migration-mode=file-handles", "--migration-verify-handles"}, "apply to --migration-mode find-paths only"},
		{[]string{"--migration-mode=file-handles", "--migration-confirm-paths"}, "apply to --migration-mode find-paths only"},
		{[]string{"--migration-mode=file-handles", "--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:"}, "cannot work in a user namespace"},
		{[]string{"--thread-pool-size=-1"}, "non-negative"},
		{[]string{"--cache-size=48M"}, `invalid argument "48M" for "--cache-size" flag: "48M": cache size 50331648 is not a power of two; want 0 (no DAX window) or a power of two from 2M to 512M`},
		{[]string{"--cache-size=1M"}, "invalid argument"},
		{[]string{"--cache-size=1G"}, "invalid argument"},
		{[]string{"--cache-size=lots"}, `invalid argument "lots" for "--cache-size" flag: "lots" is not a size`},
		{[]string{"--inode-dax=some"}, "invalid argument"},
		{[]string{"--thread-pool-size=lots"}, "non-negative"},
		{[]string{"--rlimit-nofile=-5"}, "non-negative"},
		{[]string{"--fd=-1"}, "non-negative"},
		{[]string{"--queues=x"}, "not a number"},
		{[]string{"--queues=0"}, "--queues 0"},
		{[]string{"-o", "timeout=-1"}, "seconds"},
		{[]string{"-o", "max_idle_threads=x"}, "non-negative"},
		{[]string{"--xattr=maybe"}, "not a boolean"},
		{[]string{"--posix-acl=sometimes"}, "not one of never, auto, always"},
		{[]string{"--posix-acl=Auto"}, "not one of never, auto, always"},
		{[]string{"-o", "security_label=maybe"}, "not one of never, auto, always"},
		{[]string{"--posix-acl", "auto"}, "unexpected arguments"}, // as the Rust daemon: only --posix-acl=auto
		{[]string{"--posix-acl=auto", "--translate-uid=guest:1000:2000:1"}, "cannot be used with --posix-acl=auto"},
		{[]string{"--translate-gid=host:0:0:1", "--posix-acl"}, "cannot be used with --posix-acl=always"},
		{[]string{"-o", "posix_acl", "--translate-gid=host:0:0:1"}, "cannot be used with --posix-acl=always"},
		{[]string{"--translate-uid=guest:1:2"}, "takes 3 numbers"},
		{[]string{"--translate-gid=shift:1:2:3"}, "unknown type"},
		{[]string{"--translate-uid=guest:0:10:10", "--translate-uid=squash-guest:5:1:1"}, "overlaps"},
		{[]string{"--translate-gid=host:0:10:10", "--translate-gid=map:20:5:1"}, "overlaps"},
		{[]string{"--uid-map=0:1000:1"}, "want :inside:outside:count:"},
		{[]string{"--gid-map=:0:x:1:"}, "not an id"},
		// Conflicts and requirements.
		{[]string{"--socket-group=kvm"}, "cannot be used with --fd"},
	} {
		args := append(slices.Clone(base), tc.args...)
		_, err := parse(args)
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%q: error %v, want one containing %q", args, err, tc.err)
		}
	}
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"--fd=3"}, "--shared-dir (or -o source=) is required"},
		{[]string{"--shared-dir=/s"}, "exactly one of --socket-path and --fd"},
		{[]string{"--shared-dir=/s", "--fd=3", "--socket-path=/v"}, "exactly one of --socket-path and --fd"},
		{[]string{"--shared-dir=/s", "--socket-group=0"}, "exactly one of --socket-path and --fd"},
	} {
		_, err := parse(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%q: error %v, want one containing %q", tc.args, err, tc.err)
		}
	}
}

// regexpOKey matches -o KEY given alone, with a value, or as no_KEY, in
// a joined argument list.
func regexpOKey(key string) *regexp.Regexp {
	return regexp.MustCompile(`[ ,](no_)?` + regexp.QuoteMeta(key) + `[ ,=]`)
}

// TestNoStrayLongForms: the long flags are the table's and cobra's
// --help; the C daemon's -d, -f, -s and -o have no long form, whatever
// name pflag holds them under.
func TestNoStrayLongForms(t *testing.T) {
	long := map[string]bool{"help": true}
	for _, opt := range optionTable {
		if opt.long != "" {
			long[opt.long] = true
		}
	}
	var shorts []string
	newCommand(nil).Flags().VisitAll(func(f *pflag.Flag) {
		switch {
		case isShortOnly(f):
			shorts = append(shorts, f.Shorthand)
		case !long[f.Name]:
			t.Errorf("--%s is not an option of the table", f.Name)
		}
	})
	if want := []string{"d", "f", "o", "s"}; !slices.Equal(shorts, want) {
		t.Errorf("short-only flags %q, want %q", shorts, want)
	}
	for _, s := range shorts {
		for _, arg := range []string{"--" + s, "--short-" + s, "--" + shortOnlyName(s)} {
			if _, err := parse(append(slices.Clone(base), arg)); err == nil || !regexp.MustCompile(`^(unknown flag: --|bad flag syntax: ---)`).MatchString(err.Error()) {
				t.Errorf("%s: error %v, want an unknown flag", arg, err)
			}
		}
	}
	if _, err := parse(append(slices.Clone(base), "--options=xattr")); err == nil || err.Error() != "unknown flag: --options" {
		t.Errorf("--options: error %v, want unknown flag: --options", err)
	}
}

// TestShortFlagErrors: an error in a short-only flag's value names it as
// it is written.
func TestShortFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"-o", "bogus"}, `invalid argument "bogus" for "-o" flag: unknown option -o bogus`},
		{[]string{"-d=maybe"}, `invalid argument "maybe" for "-d" flag: "maybe" is not a boolean`},
		{[]string{"--cache=x"}, `invalid argument "x" for "--cache" flag: "x" is not one of`},
	} {
		cmd := newCommand(nil)
		cmd.SetArgs(append(slices.Clone(base), tc.args...))
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		if err := cmd.Execute(); err == nil || !strings.HasPrefix(err.Error(), tc.err) {
			t.Errorf("%q: error %v, want %s...", tc.args, err, tc.err)
		}
	}
}

// TestHelp: --help shows every option, with each of its spellings and its
// default; a value is named, never "string" or "int"; a default that
// depends on the machine is said in words.
func TestHelp(t *testing.T) {
	cmd := newCommand(nil)
	var out strings.Builder
	cmd.SetArgs([]string{"--help"})
	cmd.SetOut(&out)
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	help := out.String()
	o := newOptions()
	for _, opt := range optionTable {
		lead := opt.oSpelling() // how the option's line starts
		switch {
		case opt.short != "":
			lead = "-" + opt.short
		case opt.long != "":
			lead = "--" + opt.long
		}
		var line string
		for _, l := range strings.Split(help, "\n") {
			if l = strings.TrimSpace(l); strings.HasPrefix(l, lead+" ") || strings.HasPrefix(l, lead+",") || strings.HasPrefix(l, lead+"[=") {
				line = l
			}
		}
		if line == "" {
			t.Errorf("no line for %+v in\n%s", opt, help)
			continue
		}
		if s := opt.oSpelling(); s != "" && !strings.Contains(line, s) {
			t.Errorf("%q: no %q", line, s)
		}
		if opt.kind != optBool && valueName(opt.usage) == "" {
			t.Errorf("%q: the value has no name", line)
		}
		if def := opt.defaultValue(o); def != "" && def != "false" && !strings.Contains(line, "(default ") {
			t.Errorf("%q: no default (%s)", line, def)
		}
	}
	for _, want := range []string{
		`--cache MODE `, `-o cache=MODE (default "auto")`,
		`--queues N `, `(default 255)`,
		`-o log_level=LEVEL (default "info")`,
		`--inode-file-handles MODE `, `(default "prefer")`,
		`(default one fewer than the CPUs, at least 1)`,
		`(default raised to min(1000000, fs.nr_open))`,
		`--inode-fd-budget N `, `(default half of RLIMIT_NOFILE)`,
		`--sandbox MODE `, `(default "namespace")`, `(default "kill")`,
		`-o [no_]posix_lock `, `(default no_posix_lock)`,
		`-d, -o debug `, `-o OPTIONS `,
		// As the Rust daemon 1.14 spells them (--posix-acl[=<never|auto|always>]).
		`--posix-acl[=always] `, `--security-label[=always] `, `-o [no_]posix_acl[=MODE] (default never)`,
	} {
		if !strings.Contains(help, want) {
			t.Errorf("no %q in --help:\n%s", want, help)
		}
	}
	for _, bad := range []string{" string ", " int ", "---"} {
		if strings.Contains(help, bad) {
			t.Errorf("%q in --help:\n%s", bad, help)
		}
	}
}

func TestParseSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"0", 0, true}, {"4096", 4096, true}, {"2M", 2 << 20, true}, {"2m", 2 << 20, true},
		{"512M", 512 << 20, true}, {"64k", 64 << 10, true}, {"1G", 1 << 30, true}, {"16777216G", 1 << 54, true},
		{"", 0, false}, {"M", 0, false}, {"-2M", 0, false}, {"+2M", 0, false}, {"2MB", 0, false},
		{"2T", 0, false}, {"1.5M", 0, false}, {" 2M", 0, false}, {"17179869184G", 0, false},
		{"18446744073709551616", 0, false},
	} {
		got, err := parseSize(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}
