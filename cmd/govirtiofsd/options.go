package main

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
)

// Options is the daemon's configuration, filled in from either flag dialect:
// the Rust virtiofsd's long options (--shared-dir DIR) and the C
// virtiofsd's -o options (-o source=DIR, libvirt's comma-joined
// -o source=DIR,cache=none). Both dialects write through the same option
// table in command-line order, so for single-valued options the last one
// given wins, whatever its spelling.
type Options struct {
	SharedDir         string
	SocketPath        string
	FD                int
	Queues            int
	Tag               string
	LogLevel          string
	PrintCapabilities bool
	Version           bool
	Foreground        bool

	// File system (internal/passthrough).
	Cache     string
	Timeout   string
	Writeback bool
	Xattr     bool
	XattrMap  string
	// PosixACL and SecurityLabel are negotiation modes, as in the Rust
	// virtiofsd 1.14: never, auto (if the guest offers it) or always
	// (the guest must offer it: INIT fails otherwise).
	PosixACL          string
	SecurityLabel     string
	AnnounceSubmounts bool
	NoReaddirplus     bool
	AllowDirectIO     bool
	KillprivV2        bool
	InodeFileHandles  string
	InodeFDBudget     int
	PosixLock         bool
	Flock             bool
	ReadOnly          bool
	PreserveNoatime   bool
	RlimitNofile      int
	ThreadPoolSize    int

	// DAX (DESIGN §13). CacheSize is --cache-size in bytes: the window
	// offered to the guest (vhostuser.Config.CacheSize), 0 for none.
	// InodeDAX is --inode-dax, which regular files get FUSE_ATTR_DAX
	// under the guest's dax=inode: "all", or "flag" (those whose host file
	// has FS_XFLAG_DAX). It is for passthrough's options, with the
	// back end's Window.
	CacheSize uint64
	InodeDAX  string

	// MetricsAddr serves Prometheus metrics: HOST:PORT, or unix:PATH.
	MetricsAddr string

	// Process and logging.
	Daemonize   bool
	SocketGroup string
	Syslog      bool
	// TranslateUID and TranslateGID hold --translate-uid/--translate-gid
	// specs in command-line order (each checked as it is parsed).
	TranslateUID []string
	TranslateGID []string
	// Migration (the Rust daemon's options).
	MigrationMode          string
	MigrationOnError       string
	MigrationVerifyHandles bool
	MigrationConfirmPaths  bool

	// Sandbox (issue 5; parsed here, applied by the sandbox code).
	Sandbox string
	Seccomp string
	Modcaps string
	UIDMaps []string
	GIDMaps []string

	// notes are the options given that have no effect here, logged at
	// start-up (once each, in command-line order).
	notes []string
	// handles is the first process's decision on inode file handles
	// (handles.go), not an option.
	handles    handleDecision
	handlesWhy string
}

// newOptions returns the defaults, as the command line starts from them.
func newOptions() *Options {
	return &Options{
		FD:               -1, // not given
		Queues:           vhostuser.MaxRings - 1,
		LogLevel:         "info",
		Cache:            "auto",
		PosixACL:         passthrough.NegotiateNever,
		SecurityLabel:    passthrough.NegotiateNever,
		InodeFileHandles: "prefer", // as the Rust virtiofsd since 1.13.3
		ThreadPoolSize:   -1,       // not given: defaultWorkers
		RlimitNofile:     -1,       // not given: setNofile raises it
		InodeDAX:         InodeDAXAll,
		MigrationMode:    "find-paths",
		MigrationOnError: "abort",
		// On by default, as in the Rust virtiofsd 1.13: a migration from
		// it carries the setting, and a destination with it off refuses
		// the state.
		AnnounceSubmounts: true,
		Sandbox:           "namespace",
		Seccomp:           "kill",
	}
}

// optKind says how an option's value is parsed.
type optKind int

const (
	optString optKind = iota
	optInt
	optBool
	// optMode is a negotiation mode (never|auto|always): given bare, or
	// as -o KEY, it is always; -o no_KEY is never.
	optMode
)

// option describes one setting and its spellings.
type option struct {
	long  string // the Rust daemon's long flag, "" if none
	short string // one-letter flag, "" if none
	oKey  string // the C daemon's -o key, "" if none
	kind  optKind
	// usage is the option's line in --help; a word in back quotes names
	// its value there (pflag's convention): "share the directory `DIR`".
	usage string
	// dflt, when set, is the default in words, for one that depends on
	// the machine or on other options; otherwise --help shows the value
	// the Options start with (field.get).
	dflt string
	// note, when set, says why the option has no effect here; it is
	// logged at start-up when the option is given (a boolean: set true).
	note string
	field
}

// field is how an option reaches its Options field.
type field struct {
	set func(o *Options, v string) error
	// get is the field's value as the command line would give it, "" if
	// none; nil for an option that has no field of its own.
	get func(o *Options) string
}

// apply sets the option from its value as given on the command line and
// records its note.
func (opt *option) apply(o *Options, v string) error {
	if err := opt.set(o, v); err != nil {
		return err
	}
	if opt.note != "" && !(opt.kind == optBool && v == "false") && !slices.Contains(o.notes, opt.note) {
		o.notes = append(o.notes, opt.note)
	}
	return nil
}

// defaultValue is the option's default as --help shows it ("" for none).
func (opt *option) defaultValue(o *Options) string {
	if opt.dflt != "" || opt.get == nil {
		return opt.dflt
	}
	return opt.get(o)
}

// optionTable lists every option the daemon understands: the Rust
// virtiofsd 1.13 and 1.14's long options and the C virtiofsd 7.2's -o options and
// short flags.
var optionTable = []option{
	{long: "shared-dir", oKey: "source", kind: optString, usage: "share the directory `DIR` (required)",
		field: stringField(func(o *Options) *string { return &o.SharedDir })},
	{long: "socket-path", kind: optString, usage: "create the vhost-user socket `PATH` and listen on it",
		field: stringField(func(o *Options) *string { return &o.SocketPath })},
	{long: "socket", kind: optString, usage: "the same as --socket-path `PATH`",
		field: stringField(func(o *Options) *string { return &o.SocketPath })},
	{long: "fd", kind: optInt, usage: "serve the inherited, already listening socket on file descriptor `N`",
		field: uintField(func(o *Options) *int { return &o.FD })},
	{long: "socket-group", kind: optString, usage: "give the socket --socket-path creates to `GROUP` (name or number), mode 0660",
		field: stringField(func(o *Options) *string { return &o.SocketGroup })},
	{long: "queues", kind: optInt, usage: "advertise `N` request queues (GET_QUEUE_NUM answers 1 + N)",
		field: intField(func(o *Options) *int { return &o.Queues })},
	{long: "tag", kind: optString, usage: "file system tag `TAG` for the device config (enables the CONFIG protocol feature)",
		field: stringField(func(o *Options) *string { return &o.Tag })},
	{long: "log-level", oKey: "log_level", kind: optString, usage: "log `LEVEL`: error (err), warn, info, debug, trace or off",
		field: enumField(func(o *Options) *string { return &o.LogLevel }, "error", "err", "warn", "warning", "info", "debug", "trace", "off")},
	{short: "d", oKey: "debug", kind: optBool, usage: "debug log level (the same as --log-level=debug)",
		field: debugField},
	{long: "syslog", kind: optBool, usage: "log to syslog (/dev/log) instead of stderr",
		field: boolField(func(o *Options) *bool { return &o.Syslog })},
	{long: "print-capabilities", kind: optBool, usage: "print the vhost-user capabilities JSON and exit",
		field: boolField(func(o *Options) *bool { return &o.PrintCapabilities })},
	{long: "version", short: "V", kind: optBool, usage: "print the version and exit",
		field: boolField(func(o *Options) *bool { return &o.Version })},
	{short: "f", kind: optBool, usage: "stay in the foreground (what the daemon does without --daemonize)",
		field: boolField(func(o *Options) *bool { return &o.Foreground })},
	{long: "daemonize", kind: optBool, usage: "run in the background: the command returns once the socket listens",
		field: boolField(func(o *Options) *bool { return &o.Daemonize })},
	{short: "s", kind: optBool, usage: "single-threaded (accepted, no effect)",
		note: "-s has no effect: see --thread-pool-size", field: noEffect(optBool)},
	{long: "cache", oKey: "cache", kind: optString, usage: "cache `MODE`: never (none), metadata, auto (normal) or always",
		field: enumField(func(o *Options) *string { return &o.Cache }, "never", "none", "metadata", "auto", "normal", "always")},
	{oKey: "timeout", kind: optString, usage: "entry and attribute timeout in `SECONDS`", dflt: "from --cache",
		field: field{set: func(o *Options, v string) error {
			if secs, err := strconv.ParseFloat(v, 64); err != nil || secs < 0 || secs > 1e9 {
				return fmt.Errorf("%q is not a number of seconds", v)
			}
			o.Timeout = v
			return nil
		}, get: func(o *Options) string { return o.Timeout }}},
	{long: "allow-mmap", kind: optBool, usage: "allow shared mmap of files (accepted, no effect: the guest maps shared files through its page cache, or its DAX window with --cache-size)",
		note: "--allow-mmap has no effect: the guest maps shared files through its page cache, or through the DAX window of --cache-size", field: noEffect(optBool)},
	{long: "cache-size", kind: optString, usage: "offer the guest a DAX window of `SIZE` bytes (K, M, G suffixes), where it maps host files instead of caching them: a power of two from 2M to 512M. QEMU 11.1's vhost-user-test-device-pci only; the VM cannot migrate",
		dflt: "0, no window", field: cacheSizeField},
	{long: "inode-dax", kind: optString, usage: "under the guest's dax=inode, which regular files use the DAX window, `WHICH`: all, or flag (those whose host file has FS_XFLAG_DAX, set by xfs_io -c 'chattr +x')",
		field: enumField(func(o *Options) *string { return &o.InodeDAX }, InodeDAXAll, InodeDAXFlag)},
	{long: "writeback", oKey: "writeback", kind: optBool, usage: "enable the guest's writeback cache",
		field: boolField(func(o *Options) *bool { return &o.Writeback })},
	{long: "xattr", oKey: "xattr", kind: optBool, usage: "enable extended attributes",
		field: boolField(func(o *Options) *bool { return &o.Xattr })},
	{long: "xattrmap", oKey: "xattrmap", kind: optString, usage: "map xattr names by `RULES` (the C daemon's syntax)",
		field: stringField(func(o *Options) *string { return &o.XattrMap })},
	{long: "posix-acl", oKey: "posix_acl", kind: optMode, usage: "POSIX ACLs (imply --xattr) `MODE`: never, auto (if the guest offers them) or always (INIT fails if it does not); the bare flag is always",
		field: modeField(func(o *Options) *string { return &o.PosixACL })},
	{long: "security-label", oKey: "security_label", kind: optMode, usage: "set the guest's security label on what it creates (FUSE_SECURITY_CTX; implies --xattr), `MODE`: never, auto (if the guest offers it) or always (INIT fails if it does not); the bare flag is always",
		field: modeField(func(o *Options) *string { return &o.SecurityLabel })},
	{long: "announce-submounts", oKey: "announce_submounts", kind: optBool, usage: "tell the guest about host submounts (distinct st_dev)",
		field: boolField(func(o *Options) *bool { return &o.AnnounceSubmounts })},
	{long: "no-announce-submounts", kind: optBool, usage: "do not announce submounts",
		field: notBoolField(func(o *Options) *bool { return &o.AnnounceSubmounts })},
	{long: "no-readdirplus", kind: optBool, usage: "do not use READDIRPLUS",
		field: boolField(func(o *Options) *bool { return &o.NoReaddirplus })},
	{oKey: "readdirplus", kind: optBool, usage: "use READDIRPLUS",
		field: notBoolField(func(o *Options) *bool { return &o.NoReaddirplus })},
	{long: "allow-direct-io", oKey: "allow_direct_io", kind: optBool, usage: "honour the guest's O_DIRECT on host files",
		field: boolField(func(o *Options) *bool { return &o.AllowDirectIO })},
	{long: "killpriv-v2", oKey: "killpriv_v2", kind: optBool, usage: "enable FUSE_HANDLE_KILLPRIV_V2",
		field: boolField(func(o *Options) *bool { return &o.KillprivV2 })},
	{long: "no-killpriv-v2", kind: optBool, usage: "disable FUSE_HANDLE_KILLPRIV_V2",
		field: notBoolField(func(o *Options) *bool { return &o.KillprivV2 })},
	{long: "inode-file-handles", kind: optString, usage: "when to hold inodes as file handles, `MODE`: never, prefer (where the file system and CAP_DAC_READ_SEARCH allow, else O_PATH fds) or mandatory",
		field: inodeFileHandlesField},
	{long: "inode-fd-budget", kind: optInt, usage: "keep at most `N` O_PATH fds open for inodes held by fd (no file handles); past it, unused inodes are closed and reopened by name, and a host-side change to one answers ESTALE (0: the default; at least 16)",
		dflt: "half of RLIMIT_NOFILE", field: uintField(func(o *Options) *int { return &o.InodeFDBudget })},
	{oKey: "posix_lock", kind: optBool, usage: "enable POSIX locks",
		field: boolField(func(o *Options) *bool { return &o.PosixLock })},
	{oKey: "flock", kind: optBool, usage: "enable flock locks",
		field: boolField(func(o *Options) *bool { return &o.Flock })},
	{long: "readonly", kind: optBool, usage: "share read-only",
		field: boolField(func(o *Options) *bool { return &o.ReadOnly })},
	{long: "preserve-noatime", kind: optBool, usage: "keep the guest's O_NOATIME",
		field: boolField(func(o *Options) *bool { return &o.PreserveNoatime })},
	{long: "rlimit-nofile", kind: optInt, usage: "set RLIMIT_NOFILE to `N` (0: leave it)", dflt: "raised to min(1000000, fs.nr_open)",
		field: uintField(func(o *Options) *int { return &o.RlimitNofile })},
	{long: "thread-pool-size", oKey: "thread_pool_size", kind: optInt, usage: "wake at most `N` extra ring servers at once, beyond one per ring (0: one server per ring)",
		dflt: "one fewer than the CPUs, at least 1", field: uintField(func(o *Options) *int { return &o.ThreadPoolSize })},
	{long: "metrics-addr", kind: optString, usage: "serve Prometheus metrics on `ADDR`, HOST:PORT or unix:PATH (off by default)",
		field: stringField(func(o *Options) *string { return &o.MetricsAddr })},
	{oKey: "max_idle_threads", kind: optInt, usage: "the C daemon's idle thread limit `N` (accepted, no effect)",
		note: "-o max_idle_threads has no effect: workers are goroutines, see --thread-pool-size", field: noEffect(optInt)},
	{oKey: "allow_root", kind: optBool, usage: "FUSE mount option (accepted, no effect)",
		note: "-o allow_root has no effect: the guest kernel decides who may access the mount", field: noEffect(optBool)},
	{long: "translate-uid", kind: optString, usage: "translate uids by `MAP` (repeatable): guest|host|squash-guest|squash-host|map:FROM:TO:COUNT, forbid-guest:FROM:COUNT",
		field: listField(func(o *Options) *[]string { return &o.TranslateUID }, checkIDMapping)},
	{long: "translate-gid", kind: optString, usage: "translate gids by `MAP` (repeatable), as --translate-uid",
		field: listField(func(o *Options) *[]string { return &o.TranslateGID }, checkIDMapping)},
	{long: "migration-mode", kind: optString, usage: "how inodes travel in a migration (source side), `MODE`: find-paths (paths relative to the shared directory) or file-handles (needs the same file system on both sides; keeps CAP_DAC_READ_SEARCH to open them)",
		field: enumField(func(o *Options) *string { return &o.MigrationMode }, "find-paths", "file-handles")},
	{long: "migration-on-error", kind: optString, usage: "what a migration's destination does when it cannot find every inode, `ACTION`: abort (fail the migration) or guest-error (let it finish; the guest gets ESTALE on those)",
		field: enumField(func(o *Options) *string { return &o.MigrationOnError }, "abort", "guest-error")},
	{long: "migration-verify-handles", kind: optBool, usage: "source side, find-paths: send each inode's file handle too, so the destination checks it opened the very same object",
		field: boolField(func(o *Options) *bool { return &o.MigrationVerifyHandles })},
	{long: "migration-confirm-paths", kind: optBool, usage: "source side, find-paths: check every inode's path again at switch-over and find it anew if it changed (a host-side rename)",
		field: boolField(func(o *Options) *bool { return &o.MigrationConfirmPaths })},

	// Sandbox options: parsed and checked here, applied by the sandbox.
	{long: "sandbox", oKey: "sandbox", kind: optString, usage: "sandbox `MODE`: namespace, chroot or none",
		field: enumField(func(o *Options) *string { return &o.Sandbox }, "namespace", "chroot", "none")},
	{long: "seccomp", oKey: "seccomp", kind: optString, usage: "what a system call off the allowlist gets, `ACTION`: kill, log, trap or none",
		field: enumField(func(o *Options) *string { return &o.Seccomp }, "kill", "log", "trap", "none")},
	{long: "modcaps", oKey: "modcaps", kind: optString, usage: "add or drop `CAPS` from the kept capabilities, e.g. +sys_admin:-mknod",
		field: stringField(func(o *Options) *string { return &o.Modcaps })},
	{long: "uid-map", kind: optString, usage: "user namespace uid `MAP` :inside:outside:count: (repeatable)",
		field: listField(func(o *Options) *[]string { return &o.UIDMaps }, checkNSMap)},
	{long: "gid-map", kind: optString, usage: "user namespace gid `MAP` :inside:outside:count: (repeatable)",
		field: listField(func(o *Options) *[]string { return &o.GIDMaps }, checkNSMap)},
}

// flagValue feeds one option's flag into the Options in command-line order.
type flagValue struct {
	o     *Options
	opt   *option
	given string // the last value given, for an option without a field
}

func (f *flagValue) String() string {
	if f.opt.get != nil {
		return f.opt.get(f.o)
	}
	return f.given
}

func (f *flagValue) Set(v string) error {
	f.given = v
	return f.opt.apply(f.o, v)
}

func (f *flagValue) Type() string {
	switch f.opt.kind {
	case optInt:
		return "int"
	case optBool:
		return "bool"
	case optMode:
		// What pflag's help calls a flag whose value is optional and
		// unnamed: it then shows --posix-acl[=always], the value the
		// bare flag means (registerFlags drops the name's back quotes).
		return "boolfunc"
	}
	return "string"
}

// oValue parses C-dialect -o arguments as they come.
type oValue struct {
	o    *Options
	seen []string
}

func (v *oValue) String() string { return strings.Join(v.seen, ",") }
func (v *oValue) Type() string   { return "options" }
func (v *oValue) Set(s string) error {
	v.seen = append(v.seen, s)
	for _, item := range splitOptions(s) {
		if err := applyO(v.o, item); err != nil {
			return err
		}
	}
	return nil
}

// splitOptions splits a comma-joined -o list; ",," is a comma inside a value
// (libvirt escapes commas in paths that way).
func splitOptions(s string) []string {
	var items []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			if i+1 < len(s) && s[i+1] == ',' {
				cur.WriteByte(',')
				i++
				continue
			}
			items = append(items, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteByte(s[i])
	}
	items = append(items, cur.String())
	return items
}

func applyO(o *Options, item string) error {
	if item == "" {
		return nil
	}
	key, val, hasVal := strings.Cut(item, "=")
	for i := range optionTable {
		opt := &optionTable[i]
		if opt.oKey == "" {
			continue
		}
		switch {
		case key == opt.oKey && (opt.kind == optBool || opt.kind == optMode) && !hasVal:
			return opt.apply(o, "true")
		case key == "no_"+opt.oKey && (opt.kind == optBool || opt.kind == optMode) && !hasVal:
			return opt.apply(o, "false")
		case key == opt.oKey && hasVal:
			if err := opt.apply(o, val); err != nil {
				return fmt.Errorf("-o %s: %w", key, err)
			}
			return nil
		}
	}
	return fmt.Errorf("unknown option -o %s", item)
}

// registerFlags adds every option of the table that has a flag, and -o,
// to flags. A long flag's usage ends with its -o spelling, if any.
func registerFlags(flags *pflag.FlagSet, o *Options) {
	for i := range optionTable {
		opt := &optionTable[i]
		if opt.long == "" && opt.short == "" {
			continue
		}
		name, usage := opt.long, opt.usage
		if name == "" {
			name = shortOnlyName(opt.short)
		} else if spelling := opt.oSpelling(); spelling != "" {
			usage += "; " + spelling
		}
		if opt.kind == optMode {
			usage = strings.ReplaceAll(usage, "`", "")
		}
		f := flags.VarPF(&flagValue{o: o, opt: opt}, name, opt.short, usage)
		f.DefValue = opt.defaultValue(o)
		switch opt.kind {
		case optBool:
			f.NoOptDefVal = "true"
		case optMode:
			f.NoOptDefVal = passthrough.NegotiateAlways
		}
		f.Hidden = opt.long == "" // pflag would list it as ---X: see shortOptionsUsage
		if opt.long == "socket" {
			f.Deprecated = "use --socket-path"
		}
	}
	flags.VarPF(&oValue{o: o}, shortOnlyName("o"), "o", oUsage).Hidden = true
}

// oUsage is -o's line in --help.
const oUsage = "the C virtiofsd's options KEY=VALUE, KEY or no_KEY, comma-joined and repeatable (\",,\" is a comma in a value); the long flags show theirs"

// shortOnlyName is the name pflag holds a flag under that has no long form:
// the C daemon's -d, -f, -s and -o. pflag gives every flag a long name;
// "-X" is one no argument can reach (pflag refuses "---X" as bad syntax),
// so --X, like any other long form, stays an unknown flag.
func shortOnlyName(short string) string { return "-" + short }

func isShortOnly(f *pflag.Flag) bool {
	return f.Shorthand != "" && f.Name == shortOnlyName(f.Shorthand)
}

// flagError names a short-only flag in a parse error as it is written
// (-o), not by the name pflag holds it under.
func flagError(_ *cobra.Command, err error) error {
	var invalid *pflag.InvalidValueError
	if errors.As(err, &invalid) && isShortOnly(invalid.GetFlag()) {
		return fmt.Errorf("invalid argument %q for \"-%s\" flag: %w", invalid.GetValue(), invalid.GetFlag().Shorthand, invalid.Unwrap())
	}
	return err
}

// oSpelling is the option as -o writes it: "-o source=DIR", or for a
// boolean "-o [no_]xattr" ("-o debug" where there is nothing to turn
// off); "" without an -o key.
func (opt *option) oSpelling() string {
	switch {
	case opt.oKey == "":
		return ""
	case opt.kind == optMode:
		return "-o [no_]" + opt.oKey + "[=" + valueName(opt.usage) + "]"
	case opt.kind != optBool:
		return "-o " + opt.oKey + "=" + valueName(opt.usage)
	case opt.get != nil:
		return "-o [no_]" + opt.oKey
	}
	return "-o " + opt.oKey
}

// valueName is the word in back quotes in usage: what --help calls the
// option's value.
func valueName(usage string) string {
	_, rest, _ := strings.Cut(usage, "`")
	name, _, _ := strings.Cut(rest, "`")
	return name
}

// validate checks what no single option can: requirements and conflicts
// between options. -V and --print-capabilities need nothing else.
func (o *Options) validate() error {
	if o.Version || o.PrintCapabilities {
		return nil
	}
	if o.SharedDir == "" {
		return errors.New("--shared-dir (or -o source=) is required")
	}
	if (o.SocketPath == "") == (o.FD < 0) {
		return errors.New("give exactly one of --socket-path and --fd")
	}
	if o.SocketGroup != "" && o.FD >= 0 {
		return errors.New("--socket-group applies to the socket --socket-path creates; it cannot be used with --fd")
	}
	if o.Queues < 1 || o.Queues > vhostuser.MaxRings-1 {
		return fmt.Errorf("--queues %d: want 1..%d", o.Queues, vhostuser.MaxRings-1)
	}
	if o.MigrationMode == "file-handles" {
		// As the Rust daemon: the two are find-paths' checks.
		if o.MigrationConfirmPaths || o.MigrationVerifyHandles {
			return errors.New("--migration-confirm-paths and --migration-verify-handles apply to --migration-mode find-paths only")
		}
		if len(o.UIDMaps) > 0 || len(o.GIDMaps) > 0 {
			return errors.New("--migration-mode file-handles cannot work in a user namespace (--uid-map/--gid-map): opening file handles needs CAP_DAC_READ_SEARCH in the host's; use find-paths")
		}
	}
	if _, err := passthrough.NewIDMap(o.TranslateUID); err != nil {
		return fmt.Errorf("--translate-uid: %w", err)
	}
	if _, err := passthrough.NewIDMap(o.TranslateGID); err != nil {
		return fmt.Errorf("--translate-gid: %w", err)
	}
	// As the Rust daemon 1.14: an ACL names host ids, which translation
	// would leave untranslated (the ACL xattrs pass through as they are),
	// so the guest would see and set other users' rights.
	if o.PosixACL != passthrough.NegotiateNever && (len(o.TranslateUID) > 0 || len(o.TranslateGID) > 0) {
		return fmt.Errorf("--translate-uid and --translate-gid cannot be used with --posix-acl=%s: translating ids would break POSIX ACLs", o.PosixACL)
	}
	return nil
}
