package main

import (
	"io"
	"reflect"
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

// newFlagSet returns a flag set bound to fresh Options, as newCommand builds it.
func newFlagSet() (*Options, *pflag.FlagSet) {
	o := &Options{FD: -1}
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	registerFlags(fs, o)
	return o, fs
}

func TestDialects(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want func(*Options) bool
	}{
		{"long shared dir", []string{"--shared-dir", "/x"}, func(o *Options) bool { return o.SharedDir == "/x" }},
		{"-o source", []string{"-o", "source=/y"}, func(o *Options) bool { return o.SharedDir == "/y" }},
		{"last wins across dialects", []string{"--shared-dir", "/x", "-o", "source=/y", "--shared-dir=/z"}, func(o *Options) bool { return o.SharedDir == "/z" }},
		{"libvirt comma list", []string{"-o", "source=/p,,q,cache=none,xattr"}, func(o *Options) bool {
			return o.SharedDir == "/p,q" && o.Cache == "none" && o.Xattr
		}},
		{"no_ form", []string{"--xattr", "-o", "no_xattr"}, func(o *Options) bool { return !o.Xattr }},
		{"no_readdirplus", []string{"-o", "no_readdirplus"}, func(o *Options) bool { return o.NoReaddirplus }},
		{"repeated -o accumulates", []string{"-o", "cache=always", "-o", "log_level=debug"}, func(o *Options) bool {
			return o.Cache == "always" && o.LogLevel == "debug"
		}},
		{"-f accepted", []string{"-f", "--fd=3"}, func(o *Options) bool { return o.Foreground && o.FD == 3 }},
		{"libvirt sandbox", []string{"-o", "source=/p,sandbox=chroot,modcaps=+sys_admin", "--seccomp=log"}, func(o *Options) bool {
			return o.Sandbox == "chroot" && o.Modcaps == "+sys_admin" && o.Seccomp == "log"
		}},
		{"sandbox last wins", []string{"--sandbox", "none", "-o", "sandbox=namespace"}, func(o *Options) bool { return o.Sandbox == "namespace" }},
		{"id maps accumulate", []string{"--uid-map", ":0:1000:1:", "--uid-map=:1:100000:65536:", "--gid-map", ":0:1000:1:"}, func(o *Options) bool {
			return reflect.DeepEqual(o.UIDMaps, []string{":0:1000:1:", ":1:100000:65536:"}) && reflect.DeepEqual(o.GIDMaps, []string{":0:1000:1:"})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, fs := newFlagSet()
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if !tc.want(o) {
				t.Errorf("%q gave %+v", tc.args, *o)
			}
		})
	}
}

func TestUnknownOption(t *testing.T) {
	for _, args := range [][]string{{"-o", "bogus"}, {"-o", "source=/a,nonsense=1"}, {"--bogus"}} {
		_, fs := newFlagSet()
		if err := fs.Parse(args); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}
